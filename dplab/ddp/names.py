"""The DDP variants' names, without torch: the command line offers them as choices before any
variant is built (:data:`dplab.ddp.runs.VARIANTS` maps each name to its class)."""

__all__ = ["VARIANT_NAMES"]

VARIANT_NAMES = ("bucketed", "forward_order", "per_parameter", "naive")
