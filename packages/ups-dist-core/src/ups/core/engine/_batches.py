"""Batches of any structure: moved to a device, measured, and looked into.

A batch is what the loader's ``collate`` returns: a tensor, or tuples, lists, dicts,
namedtuples and dataclasses of them, nested in any way; any object with a ``.to(device)``
method (a user's state class) is moved by that method. Strings, numbers, ``None`` and NumPy
arrays ride along unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch

from ..config._errors import UsageError

T = TypeVar("T")

LEAVES = (str, bytes, int, float, complex, bool, type(None))
"""Values a batch may carry that stay where they are."""


class BatchError(UsageError):
    """A batch the engine cannot handle: one it cannot move, or one without a tensor."""


def to_device(batch: T, device: torch.device, *, non_blocking: bool = False) -> T:
    """``batch`` with every tensor on ``device`` (copied asynchronously with ``non_blocking``
    from pinned memory), its structure and types kept.

    :raises BatchError: naming the path and type of a value that is neither a container, a
        tensor, an object with ``.to``, nor a plain value.
    """
    return _Mover(device, non_blocking).move(batch, "batch")  # type: ignore[no-any-return]


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor, in order
    (a dict's keys in their order, a dataclass's fields in theirs).

    :raises BatchError: when the batch holds no tensor with a dimension.
    """
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() > 0:  # a tensor, or one first in line
        return int(first.shape[0])
    for tensor in tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    raise BatchError(
        f"batch: found no tensor with a batch dimension in a {type(batch).__name__}; "
        "give the step a batch_size(batch) method"
    )


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``batch``, depth first, in order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors(value)
    elif isinstance(batch, list | tuple):
        for value in batch:
            yield from tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from tensors(getattr(batch, field.name))


class _Mover:
    """Moves one batch's values to a device, recursively."""

    def __init__(self, device: torch.device, non_blocking: bool) -> None:
        self.device, self.non_blocking = device, non_blocking

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=self.non_blocking)

    def move(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.move_tensor(value)
        if isinstance(value, LEAVES):
            return value
        if isinstance(value, Mapping):
            moved = {k: self.move(v, f"{path}[{k!r}]") for k, v in value.items()}
            try:
                return type(value)(moved)  # type: ignore[call-arg]
            except TypeError:  # a mapping type that cannot be built from a dict
                return moved
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            fields = zip(value._fields, value, strict=True)
            return type(value)(*(self.move(v, f"{path}.{f}") for f, v in fields))
        if isinstance(value, list | tuple):
            if all(isinstance(v, torch.Tensor) for v in value):  # the usual batch, at once
                return type(value)(self.move_tensor(v) for v in value)
            return type(value)(self.move(v, f"{path}[{i}]") for i, v in enumerate(value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {
                f.name: self.move(getattr(value, f.name), f"{path}.{f.name}")
                for f in dataclasses.fields(value)
                if f.init
            }
            return dataclasses.replace(value, **changes)
        to = getattr(value, "to", None)
        if callable(to):
            return to(self.device)
        if type(value).__module__ == "numpy":
            return value
        raise BatchError(
            f"{path}: cannot move a {type(value).__module__}.{type(value).__qualname__} to the "
            "device; a batch may hold tensors in tuples, lists, dicts, namedtuples and "
            "dataclasses, plain values, and objects with a .to(device) method"
        )
