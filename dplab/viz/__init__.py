"""Plotly figures of the course. Every figure takes data objects (StepTrace, memory breakdowns,
ring steps) and returns a ``plotly.graph_objects.Figure``; nothing here measures."""
