"""The ``sharded`` checkpoint backend: every rank writes its share of the replicated state.

For states too big for one writer. It keeps the ``local`` backend's folders, commit rule,
manifest, ``latest`` pointer, retention and fallback to the newest checkpoint that verifies
(:class:`~ups.ckpt.LocalCheckpointer`); only the replicated state is kept otherwise::

    step-100/
        skeleton.pt             the state with each tensor replaced by a meta tensor (its shape
                                and dtype, no data), and the tensors' names: rank 0 writes it
        shards/
            shard-0-0.distcp    the tensors, written with torch.distributed.checkpoint (DCP):
            shard-1-0.distcp    each rank writes a share, one file per rank
            metadata            DCP's index of the tensors: where each one is
        rank-0.pt, rank-1.pt    each rank's own state, as with ``local``
        COMMIT                  the manifest: every file above, with its size and CRC-32

A tensor is named by its path in the state (``model/0.weight``,
``optimizer/state/0/exp_avg``). Rank 0's state is the one kept: a rank offers DCP only the
tensors equal to rank 0's (same dtype, shape and 64-bit checksum of the bytes, computed on the
tensor's device), DCP gives each tensor offered by several ranks to the one with the least
to write so far, and a tensor that differs between ranks (each rank's RNG state) is written by
rank 0. Each rank checksums the files it wrote, so no rank reads the whole state back to
commit.

Loading reads the skeleton with ``torch.load(weights_only=True)`` and DCP's index through an
unpickler that allows only the classes of DCP's metadata; DCP then reads every tensor into a
tensor allocated from the skeleton (``weights_only=True`` too), on every rank. The replicated
state comes back whole on any number of ranks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import pickle
import re
import warnings
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ups.core import (
    Agreement,
    CheckpointError,
    Failure,
    FileRecord,
    FolderStorage,
    RunContext,
    UnsafeCheckpointError,
    checksum,
    decide,
    fsync_dir,
)

from ._local import LocalCheckpointer

SKELETON_FILE = "skeleton.pt"
SHARDS = "shards"
"""The folder, inside a checkpoint, of DCP's files."""
METADATA_FILE = "metadata"
"""DCP's index, in :data:`SHARDS` (DCP names it ``.metadata``; a manifest's names start with a
letter or a digit)."""

_CHUNK = 1 << 22
"""Words of a tensor checksummed at a time by :func:`weighted_sum`."""
_MIX = 0x100000001B3
_MASK = (1 << 64) - 1
_SHARD_FILE = re.compile(r"shard-\d+-\d+\.distcp")

_Print = tuple[torch.dtype, tuple[int, ...], int]
"""A tensor's dtype, shape and checksum (:func:`fingerprint`)."""


class ShardedCheckpointer(LocalCheckpointer):
    """Keeps checkpoints as ``local`` does, the replicated state written by every rank through
    DCP (see the module doc). Its collectives, DCP's included, use ``group``."""

    storage: FolderStorage

    def _write_state(self, staged: str, state: Mapping[str, Any]) -> dict[str, FileRecord]:
        """Write this rank's share of the tensors into the staged folder's ``shards``, and on
        rank 0 the skeleton; on rank 0, return the records of every file written (each rank's
        shard files are checksummed by the rank that wrote them)."""
        shards = self.storage.path(staged) / SHARDS
        with Agreement(self.ctx, _stopped, group=self.group):
            skeleton, tensors = split(state)
            mine = {name: fingerprint(tensor) for name, tensor in tensors.items()}
        rank0 = decide(self.ctx, lambda: mine, group=self.group)
        offered = {name: t for name, t in tensors.items() if mine[name] == rank0.get(name)}
        with _one_process_quiet(self.ctx):
            dcp_save(
                offered,
                storage_writer=_ShardWriter(shards),
                process_group=self.group,
                no_dist=not self.ctx.distributed,
            )
        records = self._gather(_records(shards, self.ctx.rank))
        if not self.ctx.is_main:
            return {}
        fsync_dir(shards)
        for path in sorted(shards.iterdir()):  # DCP's index, and what a rank could not read
            if path.is_file() and f"{SHARDS}/{path.name}" not in records:
                with open(path, "rb") as file:
                    records[f"{SHARDS}/{path.name}"] = checksum(file)
        return records | {SKELETON_FILE: self._put(staged, SKELETON_FILE, skeleton)}

    def _read_state(self, key: str) -> dict[str, Any]:
        """Read the skeleton and DCP's index, allocate the tensors, and load them with DCP."""
        path = self.storage.path(key)
        with Agreement(self.ctx, _stopped, group=self.group):
            state, tensors, metadata = _prepare_load(path, self._get(key, SKELETON_FILE))
        with _one_process_quiet(self.ctx):
            dcp_load(  # in place, into the tensors of ``state``
                tensors,
                storage_reader=_ShardReader(path / SHARDS, metadata),
                process_group=self.group,
                no_dist=not self.ctx.distributed,
            )
        return state


def _records(shards: Path, rank: int) -> dict[str, FileRecord]:
    """The records of the shard files rank ``rank`` wrote into ``shards``, by their names in
    the checkpoint; none where they cannot be read back (then rank 0 reads them, to commit)."""
    found: dict[str, FileRecord] = {}
    with contextlib.suppress(OSError):
        for path in sorted(shards.glob(f"{_prefix(rank)}*")):
            with open(path, "rb") as file:
                found[f"{SHARDS}/{path.name}"] = checksum(file)
    return found


def _stopped(failed: list[Failure], error: Exception | None) -> Exception:
    """What a rank raises where a rank failed before a collective of DCP's, so that no rank
    enters one the others skip: its own error, else one naming the ranks that failed (the
    caller reports every rank's error)."""
    if error is not None:
        return error
    ranks = ", ".join(str(f.rank) for f in failed)
    return CheckpointError(f"stopped: rank{'s' if len(failed) > 1 else ''} {ranks} failed")


# ---------------------------------------------------------------------------------------------
# The state, split into its skeleton and its tensors


def split(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The skeleton of ``state`` (``{"tree": the state with each tensor replaced by a meta
    tensor of its shape and dtype, "tensors": their names, in the tree's order}``) and its
    tensors by name: the path of keys and positions joined by ``/``, with ``#2``, ``#3`` added
    to a name already taken (by a key holding a ``/``). Dicts, ordered dicts, lists and tuples
    are searched, as :func:`~ups.core.checkpoint.load` does."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            base = "/".join(path)
            name, n = base, 1
            while name in tensors:
                n += 1
                name = f"{base}#{n}"
            tensors[name] = obj
            return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
        if type(obj) in (dict, collections.OrderedDict):
            return type(obj)((k, walk(v, (*path, str(k)))) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, (*path, str(i))) for i, v in enumerate(obj))
        return obj

    tree = walk(dict(state), ())
    return {"tree": tree, "tensors": list(tensors)}, tensors


def _prepare_load(
    path: Path, skeleton: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Metadata]:
    """The state of the checkpoint ``path``'s ``skeleton`` with empty tensors in place of the
    meta ones, those tensors by name, and DCP's index, checked against each other."""
    metadata = read_metadata(path / SHARDS / METADATA_FILE)
    names = iter(skeleton["tensors"])
    tensors: dict[str, torch.Tensor] = {}

    def allocate(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = str(next(names, ""))
            entry = metadata.state_dict_metadata.get(name)
            if not isinstance(entry, TensorStorageMetadata) or (
                entry.size != obj.shape or entry.properties.dtype != obj.dtype
            ):
                raise CheckpointError(
                    f"{path}: the skeleton's tensor {name!r} is not in the shards' index as "
                    "a tensor of its shape and dtype"
                )
            tensors[name] = torch.empty(entry.size, dtype=entry.properties.dtype)
            return tensors[name]
        if type(obj) in (dict, collections.OrderedDict):
            return type(obj)((k, allocate(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(allocate(v) for v in obj)
        return obj

    state = allocate(skeleton["tree"])
    if next(names, None) is not None:
        raise CheckpointError(f"{path}: the skeleton names more tensors than it holds")
    return state, tensors, metadata


def fingerprint(tensor: torch.Tensor) -> _Print:
    """The dtype, shape and a 64-bit checksum of the bytes of ``tensor``: on the CPU, their
    CRC-32 and Adler-32 (zlib: GB/s); elsewhere, one computed on the tensor's device
    (:func:`weighted_sum`), so that no rank copies the whole state off its device to check it."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":
        buffer = data.numpy().data
        check = zlib.crc32(buffer) << 32 | zlib.adler32(buffer)
    else:
        check = weighted_sum(data)
    return tensor.dtype, tuple(tensor.shape), check


def weighted_sum(data: torch.Tensor) -> int:
    """A 64-bit checksum of the bytes ``data`` (a flat ``uint8`` tensor), computed on their
    device: their 32-bit words (bytes, when they do not divide in words) times fixed odd random
    weights, summed modulo 2**64 a chunk at a time, the chunks' sums mixed in order."""
    words = data
    if data.numel() % 4 == 0:  # a copy aligns a view that starts mid-word
        words = (data if data.storage_offset() % 4 == 0 else data.clone()).view(torch.int32)
    weights = _weights(words.device)
    sums = [
        (part.to(torch.int64) * weights[: part.numel()]).sum()
        for part in torch.split(words, _CHUNK)
    ]
    total = 0
    for chunk in torch.stack(sums).tolist():
        total = (total * _MIX + chunk) & _MASK
    return total


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    """The weights of :func:`weighted_sum`, the same in every process, kept on ``device``."""
    generator = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(-(2**63), 2**63 - 1, (_CHUNK,), generator=generator) | 1
    return weights.to(device)


# ---------------------------------------------------------------------------------------------
# DCP's files


def _prefix(rank: int) -> str:
    return f"shard-{rank}-"


class _ShardWriter(FileSystemWriter):
    """torch's writer, naming its files as a manifest allows: ``shard-<rank>-<n>.distcp`` and
    :data:`METADATA_FILE` (torch's are ``__<rank>_<n>.distcp`` and ``.metadata``)."""

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(
                plan, storage_data=dataclasses.replace(plan.storage_data, prefix=_prefix(rank))
            )
            for rank, plan in enumerate(super().prepare_global_plan(plans))
        ]

    def _get_metadata_path(self, rank: int | None = None) -> os.PathLike[str]:
        return Path(self.path) / METADATA_FILE


class _ShardReader(FileSystemReader):
    """torch's reader, given DCP's index already read by :func:`read_metadata`."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._index = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._index


_METADATA_CLASSES = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}
"""What DCP's index of tensors written by a :class:`_ShardWriter` refers to, besides dtypes."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's index, refusing anything but its own classes and dtypes (DCP's reader
    would unpickle whatever the file holds)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(path: Path) -> Metadata:
    """DCP's index of the tensors of a checkpoint, each in a shard file of the folder.

    :raises UnsafeCheckpointError: when it holds what is not part of DCP's metadata.
    :raises CheckpointError: when it is not DCP's metadata, or names other files.
    """
    with open(path, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file).load()
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(f"refusing to load {path}: {error}") from None
    if not isinstance(metadata, Metadata) or not all(
        _SHARD_FILE.fullmatch(getattr(info, "relative_path", ""))
        for info in (metadata.storage_data or {}).values()
    ):
        raise CheckpointError(f"{path} is not DCP's index of shard files")
    return metadata


@contextlib.contextmanager
def _one_process_quiet(ctx: RunContext) -> Iterator[None]:
    """Without a process group, DCP warns that it assumes one process: that is the intent.
    (The filter is process-wide while it lasts: ``warnings`` has no other.)"""
    if ctx.distributed:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield
