"""dplab.DDP under bad input (docs/reliability.md): a bucket cap of zero bytes is named, and a
Tracer handed to a second live DDP is refused by name.
"""

from __future__ import annotations

import pytest


def test_ddp_names_a_bucket_cap_of_zero_bytes():
    """Before: "limits must be positive byte counts, got [1048576, 0]"."""
    from dplab.ddp.buckets import bucket_plan as plan

    rows = [("w", 10, 40, "f32")]
    with pytest.raises(ValueError) as e:
        plan(rows, bucket_cap_mb=1e-12, first_bucket_cap_mb=1.0)
    assert "bucket_cap_mb=1e-12 is 0 bytes" in str(e.value)
    assert "at least 1 byte" in str(e.value)


def _two_ddps_one_tracer() -> str:
    import torch

    import dplab

    tracer = dplab.Tracer()
    first = dplab.DDP(torch.nn.Linear(4, 4), tracer=tracer)  # still in use
    try:
        dplab.DDP(torch.nn.Linear(4, 4), tracer=tracer)
    except ValueError as e:
        return str(e)
    return f"accepted beside {type(first).__name__}"


def test_a_tracer_given_to_a_second_ddp_is_refused_by_name():
    """Before: accepted, then an IndexError inside a grad hook of the first DDP's backward."""
    from dplab.launch import launch

    messages = launch(_two_ddps_one_tracer, 2, timeout_s=120)
    for message in messages:
        assert "already records another dplab.DDP" in message
        assert "its own Tracer" in message
