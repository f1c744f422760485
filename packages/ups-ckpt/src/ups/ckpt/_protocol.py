"""The commit protocol every backend of this package follows, over the storage it keeps
checkpoints in; a backend is the storage's few primitives (see :class:`Committing`).

Saving is a collective every rank enters: all ranks learn whether the state is safe to save;
rank 0 prepares where the checkpoint is staged; every rank writes its files there (rank 0 the
replicated state, each rank its own); all ranks learn whether any rank failed (if one did, every
rank raises, naming it, and what was staged is deleted); the records of the files written (size
and CRC-32) are gathered to rank 0, which checks the staged files against them, writes the
``COMMIT`` manifest, publishes the checkpoint, points ``latest`` at it and applies retention.
Loading takes the checkpoint :func:`~ups.ckpt._latest.newest_verified` chooses, read by every
rank, a failure on any rank raised on every rank.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from ups.core import Loaded, RunContext

from .errors import CheckpointError, agree, on_main
from .manifest import Manifest
from .serialize import FileRecord, agree_safe

STATE_FILE = "state.pt"
"""The replicated state's file, written by rank 0."""

L = TypeVar("L")
"""Where a storage stages or keeps a checkpoint: a folder's path, a prefix's name."""
T = TypeVar("T")


def rank_file(rank: int) -> str:
    """The file of what rank ``rank`` keeps of its own."""
    return f"rank-{rank}.pt"


class Committing(abc.ABC, Generic[L]):
    """The :class:`~ups.core.Checkpointer` protocol over a storage: a subclass says how to
    stage, write, read, verify, publish and delete (its abstract methods).

    ``group``: the process group its collectives use (``None``: the default one).
    """

    def __init__(self, ctx: RunContext, group: dist.ProcessGroup | None, place: str) -> None:
        self.ctx = ctx
        self.group = group
        self._place = place
        """How messages say where the checkpoints are (``""``, ``" under s3://..."``)."""

    # -- the Checkpointer protocol ------------------------------------------------------------

    def save(self, state: Mapping[str, Any], *, step: int, rank_state: Mapping[str, Any]) -> str:
        """Save rank 0's ``state`` and every rank's ``rank_state`` as checkpoint ``step``.

        A collective: every rank calls it. Returns where it was committed, on every rank.

        :raises CheckpointError: on every rank, naming the ranks that failed and why.
        :raises UnsafeCheckpointError: when a state holds what loading would refuse.
        """
        what = f"saving checkpoint step {step}{self._place}"
        agree_safe(self.ctx, what, step=step, state=state, rank_state=rank_state, group=self.group)
        staged = self._on_main(what, lambda: self._begin(step))
        written: dict[str, FileRecord] = {}
        error: Exception | None = None
        try:
            written = self._write_state(staged, state)
            own = rank_file(self.ctx.rank)
            written[own] = self._put(staged, own, rank_state)
        except Exception as caught:  # every rank learns of it below
            error = caught
        try:
            agree(self.ctx, what, error, self.group)
        except CheckpointError:
            if self.ctx.is_main:
                self._discard(staged)
            raise
        files = self._gather(written)
        return self._on_main(what, lambda: self._commit(staged, step, files))

    def load_latest(self) -> Loaded | None:
        """Load the checkpoint ``latest`` names, else the newest committed one that verifies,
        on every rank; ``None`` when there is none.

        :raises CheckpointError: on every rank, when any rank cannot read it.
        :raises UnsafeCheckpointError: when a file would run code to load (on every rank).
        """
        found = self._on_main(f"finding the latest checkpoint{self._place}", self._find_latest)
        if found is None:
            return None
        where, step, saved_world = found
        state: dict[str, Any] = {}
        own: dict[str, Any] | None = None
        error: Exception | None = None
        try:
            state = self._read_state(where)
            if saved_world == self.ctx.world_size:
                own = self._get(where, rank_file(self.ctx.rank))
        except Exception as caught:  # every rank learns of it below
            error = caught
        location = self._location_of(where)
        agree(self.ctx, f"loading checkpoint {location}", error, self.group)
        return Loaded(step=step, state=state, rank_state=own, location=location)

    def wait(self) -> None:
        """Nothing to wait for: :meth:`save` returns once the checkpoint is committed."""

    # -- how the replicated state is kept (a subclass may keep it otherwise) -------------------

    def _write_state(self, staged: L, state: Mapping[str, Any]) -> dict[str, FileRecord]:
        """Write the replicated ``state`` where the checkpoint is ``staged``; return the
        records of the files written (files no rank names are read back at commit).

        Every rank calls it, before anything that may fail on one rank only, so a subclass may
        run collectives over ``self.group`` in it. Here rank 0 writes ``state.pt``.
        """
        if not self.ctx.is_main:
            return {}
        return {STATE_FILE: self._put(staged, STATE_FILE, state)}

    def _read_state(self, where: L) -> dict[str, Any]:
        """Read the replicated state of the committed checkpoint ``where``.

        Every rank calls it, first, so a subclass may run collectives over ``self.group`` in it.
        """
        return self._get(where, STATE_FILE)

    # -- rank 0's parts -----------------------------------------------------------------------

    def _on_main(self, what: str, action: Callable[[], T]) -> T:
        return on_main(self.ctx, what, action, self.group)

    def _gather(self, written: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """Every rank's records of the files it wrote, merged, on rank 0 (``{}`` elsewhere)."""
        if not self.ctx.distributed:
            return written
        gathered: list[dict[str, FileRecord] | None] | None = None
        if self.ctx.is_main:
            gathered = [None] * self.ctx.world_size
        dist.gather_object(written, gathered, dst=0, group=self.group)
        return {name: r for records in gathered or [] for name, r in (records or {}).items()}

    def _commit(self, staged: L, step: int, files: dict[str, FileRecord]) -> str:
        """Check the staged files, write the manifest, publish, point ``latest``, retain."""
        try:
            manifest = Manifest(
                step=step,
                world_size=self.ctx.world_size,
                files=self._verify(staged, files),
                saved_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            )
            self._write_manifest(staged, manifest)
            where = self._publish(staged, step)
        except BaseException:
            self._discard(staged)
            raise
        self._point_latest(where)
        self._retain(protect=step)
        return self._location_of(where)

    # -- the storage --------------------------------------------------------------------------

    @abc.abstractmethod
    def _begin(self, step: int) -> L:
        """Rank 0: where checkpoint ``step`` is staged (at a checkpointer's first save, also
        delete what earlier runs left uncommitted)."""

    @abc.abstractmethod
    def _put(self, where: L, name: str, obj: Mapping[str, Any]) -> FileRecord:
        """Write ``obj`` into the new file ``name`` of ``where``, durably; return its record."""

    @abc.abstractmethod
    def _get(self, where: L, name: str) -> dict[str, Any]:
        """Read the file ``name`` of ``where`` (``weights_only``)."""

    @abc.abstractmethod
    def _discard(self, staged: L) -> None:
        """Rank 0: delete what a failed save staged."""

    @abc.abstractmethod
    def _verify(self, staged: L, files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """Rank 0: check that the staged files are there as ``files`` records them; return
        the records of every staged file (those no rank recorded, read back)."""

    @abc.abstractmethod
    def _write_manifest(self, staged: L, manifest: Manifest) -> None:
        """Rank 0: write ``COMMIT`` where the checkpoint is staged, durably."""

    @abc.abstractmethod
    def _publish(self, staged: L, step: int) -> L:
        """Rank 0: make the staged, manifested checkpoint the committed ``step-<step>``."""

    @abc.abstractmethod
    def _point_latest(self, where: L) -> None:
        """Rank 0: point ``latest`` at the committed checkpoint ``where``."""

    @abc.abstractmethod
    def _retain(self, protect: int) -> None:
        """Rank 0: delete what retention lets go, never checkpoint ``protect``."""

    @abc.abstractmethod
    def _find_latest(self) -> tuple[L, int, int] | None:
        """Rank 0: the checkpoint to load, its step and world size (``None``: none)."""

    @abc.abstractmethod
    def _location_of(self, where: L) -> str:
        """The path or URL of ``where``, as locations and messages give it."""
