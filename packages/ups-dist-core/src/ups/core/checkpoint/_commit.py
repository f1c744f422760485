"""The commit protocol every checkpoint backend follows: one manager, :class:`Committing`,
composed with a storage, :class:`CheckpointStorage`, that says only how to stage, write, read,
commit, list and delete checkpoints and how to keep named pointers (``latest``).

The built-in ``simple`` backend (:mod:`ups.core.checkpoint._simple`, a folder per checkpoint)
and ups-ckpt's ``local``, ``sharded`` and ``fsspec`` backends are the manager over such a
storage, so every one of them saves, commits, verifies, loads and retains checkpoints alike.

Saving is a collective every rank enters: all ranks learn whether the state is safe to save;
rank 0 stages the checkpoint (:meth:`CheckpointStorage.stage`); every rank writes its files
there (rank 0 the replicated state, each rank its own); all ranks learn whether any rank failed
(if one did, every rank raises, naming it, and what was staged is deleted); the records of the
files written (size and CRC-32) are gathered to rank 0, which checks that the staged files are
there at their sizes, commits the checkpoint as ``step-<N>`` with its ``COMMIT`` manifest
(and the evaluated values it was saved for), points ``latest`` at it, with keep-best points
``best`` at the best checkpoint (:mod:`~ups.core.checkpoint._best`: ranked by the values the
manifests record, among those of the stage saving in a run of stages) and deletes what
retention lets go
(:func:`~ups.core.checkpoint._retention.expired`), never a best one. A checkpoint without a readable ``COMMIT`` is never
loaded. Loading takes the checkpoint ``latest`` names if its files match the manifest's sizes
and CRC-32s, else the newest committed one that does (with a warning naming each damaged one
skipped), read by every rank, a failure on any rank raised on every rank; ``load_best`` the
one ``best`` names, verified alike. Every collective
runs over the manager's process group, whose timeout bounds it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime, timezone
from typing import IO, Any, ClassVar, Protocol, TypeVar

import attrs
import structlog
import torch
import torch.distributed as dist

from ..config._arguments import saved_rank_state, wrong_type
from ..dist._collectives import Agreement
from ..dist._context import RunContext
from ..plugin._records import Loaded
from ._best import BEST_POINTER, KeepBest, kept_apart, stage_best, stage_of
from ._errors import CheckpointError, disk_full, failing, on_main
from ._manifest import Manifest, read_committed
from ._retention import prune
from ._serialize import FileRecord, agree_safe, checksum, load

log = structlog.get_logger()

STATE_FILE = "state.pt"
"""The replicated state's file, written by rank 0."""
COMMIT_FILE = "COMMIT"
"""The manifest's file, in a checkpoint: written last, it commits the checkpoint."""
LATEST_FILE = "latest"
"""The pointer that names the newest committed checkpoint (beside the checkpoints, the file
``latest`` holding ``step-100``)."""

STEP_NAME = re.compile(r"step-(\d+)")
"""The key of a published checkpoint, committed or not: ``step-<N>``."""

T = TypeVar("T")


def step_key(step: int) -> str:
    """The key of checkpoint ``step`` once published: ``step-<step>``."""
    return f"step-{step}"


def rank_file(rank: int) -> str:
    """The file of what rank ``rank`` keeps of its own."""
    return f"rank-{rank}.pt"


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


class CheckpointStorage(Protocol):
    """Where a :class:`Committing` manager keeps its checkpoints, and how: nine methods.

    A checkpoint is named by a key, a string (it is sent between ranks): ``step-<N>`` once
    published, whatever :meth:`stage` returned while it is staged. A checkpoint holds files,
    named by relative paths (``state.pt``, ``rank-3.pt``, ``shards/metadata``), and is
    committed by its file ``COMMIT``, which :meth:`commit` writes last. A method marked
    "rank 0" is called on rank 0 only, the others on any rank; none is a collective. The
    manager writes no file but through :meth:`write` and :meth:`commit`, and reads none but
    through :meth:`read`; every error a method raises fails the save or the load on every
    rank, naming it (``FileNotFoundError`` from :meth:`read` excepted: see there).
    """

    def stage(self, step: int) -> str:
        """Rank 0, at each save: a new, empty place for checkpoint ``step`` to be written in;
        its key. The first call on a storage object also deletes what earlier runs staged and
        never committed (no save of this object is in flight yet)."""
        ...

    def write(self, key: str, file: str, obj: Mapping[str, Any]) -> FileRecord:
        """Write ``obj`` into the new file ``file`` of the staged checkpoint ``key`` with
        :func:`~ups.core.dump`, durably (flushed and synced where the storage can); return
        the record ``dump`` returns."""
        ...

    def read(self, key: str, file: str) -> AbstractContextManager[IO[bytes]]:
        """The file ``file`` of the checkpoint ``key``, open for reading: binary, seekable.

        :raises FileNotFoundError: when there is no such file (a checkpoint without
            ``COMMIT`` is uncommitted; a file the manifest lists, missing, is damage).
        """
        ...

    def commit(self, key: str, step: int, manifest: str) -> None:
        """Rank 0: commit the staged checkpoint ``key`` as ``step-<step>``: write ``manifest``
        into its new file ``COMMIT``, durably, after every other file, and publish it under
        the key ``step-<step>``, replacing a checkpoint of that step saved before. Once it
        returns, :meth:`checkpoints` lists it and :meth:`read` reads it by that key."""
        ...

    def checkpoints(self) -> Iterable[str]:
        """The key of every published checkpoint, committed or not (``step-<N>``; keys of
        another form are ignored; staged checkpoints may be listed or not)."""
        ...

    def remove(self, key: str) -> None:
        """Rank 0: delete the checkpoint ``key`` (a published one, or one a failed save
        staged), never leaving it half deleted and looking committed: its ``COMMIT`` first,
        or the whole of it renamed out of sight first.

        :raises FileNotFoundError: when there is no such checkpoint (ignored).
        """
        ...

    def set_pointer(self, name: str, key: str) -> None:
        """Rank 0: make the pointer ``name`` (``latest``) name the published checkpoint
        ``key``, replacing what it named (atomically where the storage can)."""
        ...

    def read_pointer(self, name: str) -> str | None:
        """The key the pointer ``name`` names (``None``: no such pointer)."""
        ...

    def location(self, key: str, file: str | None = None) -> str:
        """The path or URL of the checkpoint ``key``, or of its file ``file``, as ``save``,
        :class:`~ups.core.Loaded` and messages give it (whether or not it exists)."""
        ...


STORAGE_METHODS = tuple(
    name for name in vars(CheckpointStorage) if not name.startswith("_") and name != "__init__"
)
"""The methods of a :class:`CheckpointStorage`, checked by :class:`Committing`."""


@attrs.frozen
class Committed:
    """A committed checkpoint: its key in its storage (``step-<N>``), and its manifest."""

    where: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


class Committing:
    """The :class:`~ups.core.Checkpointer` protocol (see the module doc) over ``storage``.

    :param storage: where and how the checkpoints are kept (:class:`CheckpointStorage`).
    :param where: how messages say where the checkpoints are (``"in <folder>"``,
        ``"under s3://..."``).
    :param place: how the messages of saving and loading say it (``""``,
        ``" under s3://..."``).
    :param group: the process group its collectives use (``None``: the default one).
    :param keep_last: how many of the newest committed checkpoints to keep (``None``: all).
    :param keep_every: also keep every checkpoint whose step is a multiple of it.
    :param keep_best: keep the best checkpoints by the value it monitors, of those saved
        with it (``save``'s ``metrics``), apart from ``keep_last``; point ``best`` at the best.
    :raises ArgumentTypeError: (a ``TypeError``) for a ``storage`` that lacks a method of a
        :class:`CheckpointStorage`, naming them.
    """

    gathers_rank_states: ClassVar[bool] = False
    """Whether rank 0 writes every rank's own state, gathered to it, so that no other rank
    writes (saving needs no storage that every rank reaches), rather than each rank its own."""

    def __init__(
        self,
        ctx: RunContext,
        storage: CheckpointStorage,
        *,
        where: str,
        place: str = "",
        group: dist.ProcessGroup | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: KeepBest | None = None,
    ) -> None:
        missing = [name for name in STORAGE_METHODS if not callable(getattr(storage, name, None))]
        if missing:
            raise wrong_type("storage", storage, f"a CheckpointStorage (no {', '.join(missing)})")
        self.ctx = ctx
        self.storage = storage
        self.group = group
        self._place = place
        self._where = where
        self._keep_last = keep_last
        self._keep_every = keep_every
        self.keep_best = keep_best

    # -- the Checkpointer protocol ------------------------------------------------------------

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        rank_state: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> str:
        """Save rank 0's ``state`` and every rank's ``rank_state`` (``None``: none, loaded
        back as ``{}``) as checkpoint ``step``, its manifest recording rank 0's ``metrics``
        (the evaluated values it is saved for: keep-best ranks it by its monitored one; in a run of
        stages also ``stage``, the index of the stage saving, given to every save of a stage
        with keep-best).

        A collective: every rank calls it. Returns where it was committed, on every rank.

        :raises ArgumentTypeError: (a ``TypeError``) on this rank, before any collective, for a
            ``state`` or ``rank_state`` that is not a mapping.
        :raises CheckpointError: on every rank, naming the ranks that failed and why.
        :raises UnsafeCheckpointError: when a state holds what loading would refuse.
        """
        rank_state = saved_rank_state(state, rank_state)
        what = f"saving checkpoint step {step}{self._place}"
        agree_safe(self.ctx, what, step=step, state=state, rank_state=rank_state, group=self.group)
        staged = self._on_main(what, lambda: self.storage.stage(step))
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
        recorded = dict(metrics or {})
        return self._on_main(what, lambda: self._commit(staged, step, files, recorded))

    def load_latest(self) -> Loaded | None:
        """Load the checkpoint ``latest`` names, else the newest committed one that verifies,
        on every rank; ``None`` when there is none.

        :raises CheckpointError: on every rank, when any rank cannot read it.
        :raises UnsafeCheckpointError: when a file would run code to load (on every rank).
        """
        found = self._on_main(f"finding the latest checkpoint{self._place}", self._find_latest)
        return None if found is None else self._load(found)

    def load_best(self) -> Loaded | None:
        """Load the checkpoint the ``best`` pointer names (keep-best's best), on every rank;
        ``None`` when there is no such pointer (no keep-best, or nothing ranked yet).

        :raises CheckpointError: on every rank, when it is not committed, is damaged, or any
            rank cannot read it.
        :raises UnsafeCheckpointError: when a file would run code to load (on every rank).
        """
        found = self._on_main(f"finding the best checkpoint{self._place}", self._find_best)
        return None if found is None else self._load(found)

    def _load(self, found: Committed) -> Loaded:
        """Read the committed checkpoint ``found`` on every rank (this rank's own state when
        it was saved by as many ranks)."""
        own: dict[str, Any] | None = None
        location = self.storage.location(found.where)
        with Agreement(self.ctx, failing(f"loading checkpoint {location}"), group=self.group):
            state = self._read_state(found.where)
            if found.manifest.world_size == self.ctx.world_size:
                own = self._get(found.where, rank_file(self.ctx.rank))
        return Loaded(step=found.step, state=state, rank_state=own, location=location)

    def wait(self) -> None:
        """Nothing to wait for: :meth:`save` returns once the checkpoint is committed."""

    def location(self, step: int) -> str:
        """Where checkpoint ``step`` is once committed."""
        return self.storage.location(step_key(step))

    def committed(self) -> list[Committed]:
        """The committed checkpoints, oldest step first (listed on this rank)."""
        found = []
        for key in self.storage.checkpoints():
            if not STEP_NAME.fullmatch(key):
                continue
            text = self._read_manifest(key)
            manifest = read_committed(text, key, self.storage.location(key))
            if manifest is not None:
                found.append(Committed(key, manifest))
        return sorted(found, key=lambda c: c.step)

    # -- how the replicated state is kept (a subclass may keep it otherwise) -------------------

    def _write_state(self, staged: str, state: Mapping[str, Any]) -> dict[str, FileRecord]:
        """Write the replicated ``state`` into the checkpoint ``staged``; return the records of
        every file written (a file no rank records is not in the manifest).

        Every rank calls it, before anything that may fail on one rank only, so a subclass may
        run collectives over ``self.group`` in it. Here rank 0 writes ``state.pt``.
        """
        if not self.ctx.is_main:
            return {}
        return {STATE_FILE: self._put(staged, STATE_FILE, state)}

    def _read_state(self, key: str) -> dict[str, Any]:
        """Read the replicated state of the committed checkpoint ``key``.

        Every rank calls it, first, so a subclass may run collectives over ``self.group`` in it.
        """
        return self._get(key, STATE_FILE)

    # -- files, through the storage -----------------------------------------------------------

    def _put(self, key: str, file: str, obj: Mapping[str, Any]) -> FileRecord:
        return self.storage.write(key, file, obj)

    def _get(self, key: str, file: str) -> dict[str, Any]:
        """Read ``file`` of ``key`` (:func:`~ups.core.load`: ``weights_only``)."""
        with self.storage.read(key, file) as stream:
            return load(stream, self.storage.location(key, file))

    def _checksum(self, key: str, file: str) -> FileRecord:
        """The record of ``file`` of ``key`` as it is now.

        :raises FileNotFoundError: when there is no such file.
        """
        with self.storage.read(key, file) as stream:
            return checksum(stream)

    def _read_manifest(self, key: str) -> str | None:
        """The text of ``key``'s ``COMMIT`` (``None``: there is none)."""
        try:
            with self.storage.read(key, COMMIT_FILE) as stream:
                return stream.read().decode()
        except FileNotFoundError:
            return None

    # -- rank 0's parts -----------------------------------------------------------------------

    def _on_main(self, what: str, action: Callable[[], T]) -> T:
        return on_main(self.ctx, what, action, self.group)

    def _own_states(self, rank_state: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
        """The rank states this rank writes, by rank: its own, or, when the manager
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

    def _commit(
        self, staged: str, step: int, files: dict[str, FileRecord], metrics: dict[str, float]
    ) -> str:
        """Check the staged files, commit with the manifest, point ``latest`` (and ``best``),
        retain."""
        try:
            self._verify(staged, files)
            manifest = Manifest(
                step=step,
                world_size=self.ctx.world_size,
                files=files,
                saved_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                metrics=metrics,
            )
            self.storage.commit(staged, step, manifest.to_json())
        except BaseException:
            self._discard(staged)
            raise
        key = step_key(step)
        self.storage.set_pointer(LATEST_FILE, key)
        committed = self.committed()
        recorded = {c.step: c.manifest.metrics for c in committed}
        keep, stage = self.keep_best, stage_of(metrics)
        best = [] if keep is None else stage_best(recorded, stage, keep)
        if best:
            self.storage.set_pointer(BEST_POINTER, step_key(best[0]))
        prune(
            {c.step: c.where for c in committed},
            self.storage.remove,
            keep_last=self._keep_last,
            keep_every=self._keep_every,
            protected=step,
            kept=[*best, *kept_apart(recorded, None if keep is None else stage)],
            named=self.storage.location,
        )
        return self.storage.location(key)

    def _verify(self, staged: str, files: dict[str, FileRecord]) -> None:
        """Check that the storage has every staged file at the size recorded as it was
        written (a rank's file missing: the ranks do not share one storage)."""
        for file, record in sorted(files.items()):
            try:
                with self.storage.read(staged, file) as stream:
                    size: int | None = stream.seek(0, os.SEEK_END)
            except FileNotFoundError:
                size = None
            if size != record.size:
                raise CheckpointError(
                    f"{self.storage.location(staged, file)} is not there with the "
                    f"{record.size} bytes written (found: {size}): does every rank reach the "
                    f"same storage {self._where}?"
                )

    def _discard(self, staged: str) -> None:
        """Rank 0: delete what a failed save staged, if it can (what is left uncommitted is
        harmless, and deleted by a later checkpointer's first save)."""
        try:
            self.storage.remove(staged)
        except FileNotFoundError:
            pass
        except Exception as error:
            log.warning(
                "could not delete a failed save",
                checkpoint=self.storage.location(staged),
                error=f"{type(error).__name__}: {error}",
            )

    def _find_latest(self) -> Committed | None:
        """The checkpoint ``latest`` names, else the newest committed one, if it verifies;
        else the newest that does, with a warning naming each damaged one skipped.

        :raises CheckpointError: when checkpoints are committed but none verifies.
        """
        committed = self.committed()
        latest = (self.storage.read_pointer(LATEST_FILE) or "").strip()
        named = [c for c in committed if c.where == latest]
        if STEP_NAME.fullmatch(latest) and not named and committed:
            log.warning(
                "'latest' names no committed checkpoint", latest=self.storage.location(latest)
            )
        for candidate in named + [c for c in reversed(committed) if c not in named]:
            problem = self._damage(candidate)
            if problem is None:
                return candidate
            log.warning(
                "damaged checkpoint skipped: loading an older one",
                checkpoint=self.storage.location(candidate.where),
                damage=problem,
            )
        if committed:
            raise CheckpointError(
                f"no checkpoint {self._where} verifies against its {COMMIT_FILE} manifest "
                f"({len(committed)} damaged); move them away to start afresh"
            )
        return None

    def _find_best(self) -> Committed | None:
        """The committed checkpoint the ``best`` pointer names, if it verifies (``None``: no
        pointer).

        :raises CheckpointError: when it names no committed checkpoint, or a damaged one.
        """
        best = (self.storage.read_pointer(BEST_POINTER) or "").strip()
        if not best:
            return None
        named = [c for c in self.committed() if c.where == best]
        if not named:
            raise CheckpointError(
                f"'{BEST_POINTER}' names {self.storage.location(best)}, which is not a "
                "committed checkpoint"
            )
        problem = self._damage(named[0])
        if problem is not None:
            raise CheckpointError(f"the best checkpoint is damaged: {problem}")
        return named[0]

    def _damage(self, checkpoint: Committed) -> str | None:
        """What is wrong with a committed checkpoint's files (``None``: they match)."""
        for name, record in checkpoint.manifest.files.items():
            location = self.storage.location(checkpoint.where, name)
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
