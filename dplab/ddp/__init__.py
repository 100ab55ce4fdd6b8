"""dplab's DDP: buckets, hooks, and an asynchronous all-reduce per bucket."""

from dplab.ddp.buckets import assign_buckets, bucket_plan, first_bucket_cap
from dplab.ddp.ddp import DDP, NaiveDDP, PerParameterDDP
from dplab.trace.bucket import Bucket

__all__ = [
    "DDP",
    "Bucket",
    "NaiveDDP",
    "PerParameterDDP",
    "assign_buckets",
    "bucket_plan",
    "first_bucket_cap",
]
