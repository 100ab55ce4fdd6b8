"""ipywidgets explorers built on :mod:`dplab.viz`. Bad values are refused with a message in the
widget, never a traceback."""
