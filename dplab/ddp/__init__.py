"""dplab's DDP: buckets, hooks, an asynchronous all-reduce per bucket, and the runs that train it.

:mod:`~dplab.ddp.runs` holds the rank functions (``measure_ddp``, ``compare_with_torch``) that
train and trace DDP steps; they return ``StepTrace`` objects and small dataclasses.
:class:`~dplab.ddp.textbook.TextbookDDP` is the same mechanism in one class to read
(``textbook.py``); :class:`DDP` is torch's DistributedDataParallel, argument for argument.
"""

from dplab.ddp.accumulate import accumulate
from dplab.ddp.buckets import assign_buckets, bucket_plan, first_bucket_cap
from dplab.ddp.ddp import DDP
from dplab.ddp.runs import (
    VARIANTS,
    TorchComparison,
    compare_with_torch,
    measure_ddp,
    train_step,
    wrap,
)
from dplab.ddp.textbook import TextbookDDP
from dplab.ddp.variants import ForwardOrderDDP, NaiveDDP, PerParameterDDP
from dplab.trace.bucket import Bucket

__all__ = [
    "DDP",
    "VARIANTS",
    "Bucket",
    "ForwardOrderDDP",
    "NaiveDDP",
    "PerParameterDDP",
    "TextbookDDP",
    "TorchComparison",
    "accumulate",
    "assign_buckets",
    "bucket_plan",
    "compare_with_torch",
    "first_bucket_cap",
    "measure_ddp",
    "train_step",
    "wrap",
]
