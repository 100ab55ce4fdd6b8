"""dplab's DDP: buckets, hooks, and an asynchronous all-reduce per bucket."""

from dplab.ddp.buckets import Bucket, assign_buckets, bucket_plan
from dplab.ddp.ddp import DDP, NaiveDDP, PerParameterDDP

__all__ = ["DDP", "Bucket", "NaiveDDP", "PerParameterDDP", "assign_buckets", "bucket_plan"]
