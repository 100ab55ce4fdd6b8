"""dplab's DDP: buckets, hooks, an asynchronous all-reduce per bucket, and the runs that train it.

:mod:`~dplab.ddp.runs` holds the rank functions (``measure_ddp``, ``compare_with_torch``) that
train and trace DDP steps; they return ``StepTrace`` objects and small dataclasses.
:class:`~dplab.ddp.textbook.TextbookDDP` is the same mechanism in one class to read
(``textbook.py``); :class:`DDP` is torch's DistributedDataParallel, argument for argument.
"""

from dplab._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    globals(),
    {
        "dplab.ddp.accumulation": ["accumulate"],
        "dplab.ddp.buckets": ["assign_buckets", "bucket_plan", "first_bucket_cap"],
        "dplab.ddp.ddp": ["DDP"],
        "dplab.ddp.runs": [
            "VARIANTS",
            "TorchComparison",
            "compare_with_torch",
            "measure_ddp",
            "train_step",
            "wrap",
        ],
        "dplab.ddp.textbook": ["TextbookDDP"],
        "dplab.ddp.variants": ["ForwardOrderDDP", "NaiveDDP", "PerParameterDDP"],
        "dplab.trace.bucket": ["Bucket"],
    },
)
