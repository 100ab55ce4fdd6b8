"""One palette for the whole course, so a colour means the same thing in every figure."""

COLORS = {
    # timelines
    "forward": "#4C78A8",
    "backward": "#72B7B2",
    "allreduce": "#F58518",
    "allgather": "#B279A2",  # a sharded step's other collectives (§9b)
    "reduce_scatter": "#D67195",
    "broadcast": "#8C6D31",
    "exposed": "#E45756",
    "wait": "#BAB0AC",
    "optimizer": "#54A24B",
    "bucket_ready": "#333333",
    "predicted": "#9D755D",
    # memory
    "weights": "#4C78A8",
    "grads": "#72B7B2",
    "optimizer_state": "#54A24B",
    "master_weights": "#EECA3B",
    "activations": "#B279A2",
    "buckets": "#F58518",
    "capacity": "#E45756",
}

FONT = {"family": "Inter, Helvetica, Arial, sans-serif", "size": 13}


def layout(fig, *, title: str, height: int = 360):
    """The common look: white background, title, compact margins."""
    fig.update_layout(
        title={"text": title, "x": 0.01},
        template="plotly_white",
        font=FONT,
        height=height,
        margin={"l": 70, "r": 20, "t": 50, "b": 45},
        legend={"orientation": "h", "y": -0.18},
    )
    return fig
