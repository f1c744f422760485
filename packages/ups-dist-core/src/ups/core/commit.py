"""The commit protocol every checkpoint storage follows: one protocol, storages that say only
how to stage, write, read, list, publish and delete (the abstract methods of :class:`Committing`).

The built-in ``simple`` backend (:mod:`ups.core.simple_checkpoint`, a folder per checkpoint)
and ups-ckpt's ``local``, ``sharded`` and ``fsspec`` backends are such storages, so every one of
them saves, commits, verifies, loads and retains checkpoints alike.

Saving is a collective every rank enters: all ranks learn whether the state is safe to save;
rank 0 prepares where the checkpoint is staged; every rank writes its files there (rank 0 the
replicated state, each rank its own); all ranks learn whether any rank failed (if one did, every
rank raises, naming it, and what was staged is deleted); the records of the files written (size
and CRC-32) are gathered to rank 0, which checks the staged files against them, writes the
``COMMIT`` manifest, publishes the checkpoint as ``step-<N>``, points ``latest`` at it and
deletes what retention lets go (:func:`~ups.core.retention.expired`). A checkpoint without a
readable ``COMMIT`` is never loaded. Loading takes the checkpoint ``latest`` names if its files
match the manifest's sizes and CRC-32s, else the newest committed one that does (with a warning
naming each damaged one skipped), read by every rank, a failure on any rank raised on every
rank. Every collective runs over the checkpointer's process group, whose timeout bounds it.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, ClassVar, Generic, TypeVar

import attrs
import structlog
import torch
import torch.distributed as dist

from .arguments import saved_rank_state
from .checkpoint_errors import CheckpointError, disk_full, failing, on_main
from .collectives import Agreement
from .context import RunContext
from .manifest import Manifest, read_committed
from .records import Loaded
from .retention import prune
from .serialize import FileRecord, agree_safe

log = structlog.get_logger()

STATE_FILE = "state.pt"
"""The replicated state's file, written by rank 0."""
COMMIT_FILE = "COMMIT"
"""The manifest's file, in a checkpoint: written last, it commits the checkpoint."""
LATEST_FILE = "latest"
"""The file, beside the checkpoints, that names the newest one (``step-100``)."""

STEP_NAME = re.compile(r"step-(\d+)")
"""The name of a checkpoint, committed or not: ``step-<N>``."""

L = TypeVar("L")
"""Where a storage stages or keeps a checkpoint: a folder's path, a prefix's name."""
T = TypeVar("T")


def _tensor_bytes(obj: object) -> int:
    """The bytes of the tensors in ``obj`` and the containers in it: about what saving it
    writes."""
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.nelement()
    if isinstance(obj, Mapping):
        return sum(map(_tensor_bytes, obj.values()))
    if isinstance(obj, list | tuple):
        return sum(map(_tensor_bytes, obj))
    return 0


def rank_file(rank: int) -> str:
    """The file of what rank ``rank`` keeps of its own."""
    return f"rank-{rank}.pt"


@attrs.frozen
class Committed(Generic[L]):
    """A committed checkpoint: where its storage keeps it, and its manifest."""

    where: L
    """Its folder's path, or its prefix's name."""
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


class Committing(abc.ABC, Generic[L]):
    """The :class:`~ups.core.Checkpointer` protocol over a storage (see the module doc): a
    subclass says how to stage, write, read, list, publish and delete (its abstract methods).

    :param group: the process group its collectives use (``None``: the default one).
    :param place: how messages of saving and loading say where the checkpoints are (``""``,
        ``" under s3://..."``).
    :param where: how other messages say it (``"in <folder>"``, ``"under s3://..."``).
    :param keep_last: how many of the newest committed checkpoints to keep (``None``: all).
    :param keep_every: also keep every checkpoint whose step is a multiple of it.
    """

    gathers_rank_states: ClassVar[bool] = False
    """Whether rank 0 writes every rank's own state, gathered to it, so that no other rank
    writes (saving needs no storage that every rank reaches), rather than each rank its own."""

    def __init__(
        self,
        ctx: RunContext,
        group: dist.ProcessGroup | None,
        place: str,
        where: str,
        *,
        keep_last: int | None,
        keep_every: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.group = group
        self._place = place
        self._where = where
        self._keep_last = keep_last
        self._keep_every = keep_every

    # -- the Checkpointer protocol ------------------------------------------------------------

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        rank_state: Mapping[str, Any] | None = None,
    ) -> str:
        """Save rank 0's ``state`` and every rank's ``rank_state`` (``None``: none, loaded
        back as ``{}``) as checkpoint ``step``.

        A collective: every rank calls it. Returns where it was committed, on every rank.

        :raises ArgumentTypeError: (a ``TypeError``) on this rank, before any collective, for a
            ``state`` or ``rank_state`` that is not a mapping.
        :raises CheckpointError: on every rank, naming the ranks that failed and why.
        :raises UnsafeCheckpointError: when a state holds what loading would refuse.
        """
        rank_state = saved_rank_state(state, rank_state)
        what = f"saving checkpoint step {step}{self._place}"
        agree_safe(self.ctx, what, step=step, state=state, rank_state=rank_state, group=self.group)
        staged = self._on_main(what, lambda: self._begin(step))
        owns = self._own_states(rank_state)
        try:
            with Agreement(self.ctx, failing(what), group=self.group):
                try:
                    written = self._write_state(staged, state)
                    for rank, own in owns.items():
                        written[rank_file(rank)] = self._put(staged, rank_file(rank), own)
                except Exception as caught:  # said as a full disk where it was one
                    writes = [*owns.values(), *([state] if self.ctx.is_main else [])]
                    full = disk_full(caught, self._where, sum(map(_tensor_bytes, writes)))
                    if full is caught:
                        raise
                    raise full from caught
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
        own: dict[str, Any] | None = None
        location = self._location_of(found.where)
        with Agreement(self.ctx, failing(f"loading checkpoint {location}"), group=self.group):
            state = self._read_state(found.where)
            if found.manifest.world_size == self.ctx.world_size:
                own = self._get(found.where, rank_file(self.ctx.rank))
        return Loaded(step=found.step, state=state, rank_state=own, location=location)

    def wait(self) -> None:
        """Nothing to wait for: :meth:`save` returns once the checkpoint is committed."""

    def location(self, step: int) -> str:
        """Where checkpoint ``step`` is once committed."""
        return self._location_of(self._named(f"step-{step}"))

    def committed(self) -> list[Committed[L]]:
        """The committed checkpoints, oldest step first (listed on this rank)."""
        found = []
        for name, where in self._published().items():
            manifest = read_committed(self._read_manifest(where), name, self._location_of(where))
            if manifest is not None:
                found.append(Committed(where, manifest))
        return sorted(found, key=lambda c: c.step)

    def _published(self) -> dict[str, L]:
        """Every checkpoint the storage lists, committed or not, by its name (``step-<N>``)."""
        return {name: where for name, where in self._listed().items() if STEP_NAME.fullmatch(name)}

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

    def _own_states(self, rank_state: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
        """The rank states this rank writes, by rank: its own, or, when the storage
        :attr:`gathers_rank_states`, on rank 0 every rank's and elsewhere none (a collective)."""
        if not self.gathers_rank_states:
            return {self.ctx.rank: rank_state}
        return dict(enumerate(self._to_main(dict(rank_state))))

    def _gather(self, written: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """Every rank's records of the files it wrote, merged, on rank 0 (``{}`` elsewhere)."""
        return {name: r for records in self._to_main(written) for name, r in records.items()}

    def _to_main(self, obj: T) -> list[T]:
        """Every rank's ``obj``, by rank, on rank 0 (``[]`` elsewhere). A collective."""
        if not self.ctx.distributed:
            return [obj]
        gathered: list[Any] | None = None
        if self.ctx.is_main:
            gathered = [None] * self.ctx.world_size
        dist.gather_object(obj, gathered, dst=0, group=self.group)
        return gathered or []

    def _commit(self, staged: L, step: int, files: dict[str, FileRecord]) -> str:
        """Check the staged files, write the manifest, publish, point ``latest``, retain."""
        try:
            manifest = Manifest(
                step=step,
                world_size=self.ctx.world_size,
                files=self._verify(staged, files),
                saved_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            )
            self._write_manifest(staged, manifest.to_json())
            where = self._publish(staged, step)
        except BaseException:
            self._discard(staged)
            raise
        self._point_latest(f"step-{step}")
        prune(
            {c.step: c.where for c in self.committed()},
            self._remove,
            keep_last=self._keep_last,
            keep_every=self._keep_every,
            protected=step,
        )
        return self._location_of(where)

    def _find_latest(self) -> Committed[L] | None:
        """The checkpoint ``latest`` names, else the newest committed one, if it verifies;
        else the newest that does, with a warning naming each damaged one skipped.

        :raises CheckpointError: when checkpoints are committed but none verifies.
        """
        committed = self.committed()
        latest = (self._read_latest() or "").strip()
        named = [c for c in committed if f"step-{c.step}" == latest]
        if STEP_NAME.fullmatch(latest) and not named and committed:
            where = self._location_of(self._named(latest))
            log.warning("'latest' names no committed checkpoint", latest=where)
        for candidate in named + [c for c in reversed(committed) if c not in named]:
            problem = self._damage(candidate)
            if problem is None:
                return candidate
            log.warning(
                "damaged checkpoint skipped: loading an older one",
                checkpoint=self._location_of(candidate.where),
                damage=problem,
            )
        if committed:
            raise CheckpointError(
                f"no checkpoint {self._where} verifies against its {COMMIT_FILE} manifest "
                f"({len(committed)} damaged); move them away to start afresh"
            )
        return None

    def _damage(self, checkpoint: Committed[L]) -> str | None:
        """What is wrong with a committed checkpoint's files (``None``: they match)."""
        for name, record in checkpoint.manifest.files.items():
            location = self._location_of_file(checkpoint.where, name)
            try:
                found = self._checksum(checkpoint.where, name)
            except FileNotFoundError:
                return f"{location} is missing"
            if found != record:
                return (
                    f"{location} has {found.size} bytes, CRC-32 {found.crc32:08x}; "
                    f"{COMMIT_FILE} says {record.size} bytes, CRC-32 {record.crc32:08x}"
                )
        return None

    # -- the storage --------------------------------------------------------------------------

    @abc.abstractmethod
    def _begin(self, step: int) -> L:
        """Rank 0: where checkpoint ``step`` is staged (at a checkpointer's first save, also
        delete what earlier runs left uncommitted)."""

    @abc.abstractmethod
    def _put(self, where: L, name: str, obj: Mapping[str, Any]) -> FileRecord:
        """Write ``obj`` into the new file ``name`` of ``where``, durably; return its record
        (:func:`~ups.core.dump`)."""

    @abc.abstractmethod
    def _get(self, where: L, name: str) -> dict[str, Any]:
        """Read the file ``name`` of ``where`` (:func:`~ups.core.load`: ``weights_only``)."""

    @abc.abstractmethod
    def _checksum(self, where: L, name: str) -> FileRecord:
        """The record of the file ``name`` of ``where`` as it is now (:func:`~ups.core.checksum`).

        :raises FileNotFoundError: when there is no such file.
        """

    @abc.abstractmethod
    def _discard(self, staged: L) -> None:
        """Rank 0: delete what a failed save staged."""

    @abc.abstractmethod
    def _verify(self, staged: L, files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """Rank 0: check that the staged files are there as ``files`` records them; return
        the records of every staged file (those no rank recorded, read back)."""

    @abc.abstractmethod
    def _write_manifest(self, staged: L, text: str) -> None:
        """Rank 0: write ``text`` into the new file ``COMMIT`` of ``staged``, durably."""

    @abc.abstractmethod
    def _publish(self, staged: L, step: int) -> L:
        """Rank 0: make the staged, manifested checkpoint the committed ``step-<step>``."""

    @abc.abstractmethod
    def _point_latest(self, name: str) -> None:
        """Rank 0: make ``latest`` name the committed checkpoint ``name``."""

    @abc.abstractmethod
    def _read_latest(self) -> str | None:
        """What ``latest`` says (``None``: there is no ``latest``)."""

    @abc.abstractmethod
    def _listed(self) -> dict[str, L]:
        """What the storage keeps beside ``latest``, by name: the checkpoints (``step-<N>``),
        committed or not; names of another form are ignored."""

    @abc.abstractmethod
    def _read_manifest(self, where: L) -> str | None:
        """The text of ``where``'s ``COMMIT`` (``None``: there is none)."""

    @abc.abstractmethod
    def _remove(self, where: L) -> None:
        """Rank 0: delete the checkpoint ``where``, never leaving it half deleted and looking
        committed (remove or hide its ``COMMIT`` first)."""

    @abc.abstractmethod
    def _named(self, name: str) -> L:
        """Where the checkpoint ``name`` (``step-<N>``) is kept once published."""

    @abc.abstractmethod
    def _location_of(self, where: L) -> str:
        """The path or URL of ``where``, as locations and messages give it."""

    def _location_of_file(self, where: L, name: str) -> str:
        """The path or URL of the file ``name`` (as the manifest lists it) of the checkpoint
        at ``where``, as messages give it: ``<location>/<name>``; a storage that keeps a
        checkpoint's files another way says where."""
        return f"{self._location_of(where)}/{name}"
