"""State files: ``torch.save`` with a CRC-32 taken as the bytes go out, and safe loading.

:func:`dump` writes through a file object of the backend's choice (a local file, an fsspec
file) and returns the size and CRC-32 the manifest records. torch's own per-record CRC-32 of
its zip format is turned off while it writes: the whole-file CRC-32 replaces it, computed by
zlib at several GB/s, which makes a save as fast as a bare ``torch.save``'s. :func:`load`
always uses ``weights_only=True``; a file that would run code raises
:class:`~ups.core.UnsafeCheckpointError` naming it.
"""

from __future__ import annotations

import collections
import io
import pickle
import typing
import zlib
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch.utils.serialization import config as serialization_config

from ..dist._collectives import Agreement
from ..dist._context import RunContext
from ._errors import CheckpointError, UnsafeCheckpointError, failing

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

CHUNK = 1 << 24
"""Bytes read at a time when checking a file's CRC-32."""


@attrs.frozen
class FileRecord:
    """What a manifest knows of one file: its size in bytes and the CRC-32 of its bytes."""

    size: int
    crc32: int


class _Counting(io.RawIOBase):
    """A write-only file that passes bytes on to ``file`` and counts and checksums them."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.size, self.crc32 = file, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        view = memoryview(data)
        self.file.write(view)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes
        return view.nbytes


def dump(obj: Any, file: IO[bytes]) -> FileRecord:
    """``torch.save`` ``obj`` into ``file`` (open for writing, at its start)."""
    counting = _Counting(file)
    with serialization_config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        torch.save(obj, typing.cast(IO[bytes], counting))
    return FileRecord(counting.size, counting.crc32)


def checksum(file: IO[bytes]) -> FileRecord:
    """The size and CRC-32 of what is left to read in ``file``."""
    size = crc = 0
    while chunk := file.read(CHUNK):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return FileRecord(size, crc)


def load(file: IO[bytes], name: str) -> dict[str, Any]:
    """Load a state dict written by :func:`dump` with ``weights_only=True``.

    :param name: the file's path or URL, for errors.
    :raises UnsafeCheckpointError: when the file holds objects that would run code to load.
    :raises CheckpointError: when it holds something else than a dict.
    """
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"refusing to load {name}: it holds objects that loading would have to run code "
            f"for ({unpickling_reason(error)}); only tensors, numbers, strings and "
            "containers of them are loaded"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{name} holds a {type(obj).__name__}, not a state dict")
    return obj


def check_safe(obj: Any) -> None:
    """Refuse a state that loading with ``weights_only=True`` would refuse, before saving it
    (a saved checkpoint that cannot be loaded is a lost run). Pickles the state's structure,
    not its tensor data."""
    buffer = io.BytesIO()
    torch.save(_skeleton(obj), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"the state holds objects that loading with weights_only=True refuses "
            f"({unpickling_reason(error)}); save tensors, numbers, strings and "
            "lists/dicts of them"
        ) from None


def agree_safe(
    ctx: RunContext,
    what: str,
    *,
    step: int,
    state: Mapping[str, Any],
    rank_state: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Before a save writes or deletes anything: check ``step`` and that both states load
    with ``weights_only=True`` (the replicated one on rank 0); raise on every rank if not.

    :raises UnsafeCheckpointError: naming the objects loading would refuse.
    :raises CheckpointError: for a bad step.
    """
    with Agreement(ctx, failing(what), group=group):
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        check_safe(rank_state)
        if ctx.is_main:
            check_safe(state)


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by an empty one of its dtype (same pickle types)."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, _skeleton(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def unpickling_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only message that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line.rstrip(".")
    return lines[-1].rstrip(".") if lines else "unsupported pickle content"
