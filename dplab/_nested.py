"""Walking the tensors inside a forward's output: a tensor, or lists, tuples, dicts and
dataclasses of them (the containers torch's DDP looks through)."""

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))
