"""The ``local`` checkpoint backend: one folder per checkpoint, committed atomically.

Layout under the run's folder::

    checkpoints/
        step-100/           a committed checkpoint
            state.pt        the replicated state, written by rank 0
            rank-0.pt       what each rank keeps of its own (its RNG state)
            rank-1.pt
            COMMIT          the manifest, written last: step, world size, files, sizes, CRC-32s
        latest              the name of the newest checkpoint ("step-100"), replaced atomically
        .tmp-step-150-1f2e  a save in progress, or one that crashed: never loaded

A save is a collective every rank enters. Rank 0 makes the temporary folder; every rank writes
and fsyncs its files there; all ranks learn whether any rank failed; rank 0 writes ``COMMIT``,
fsyncs the folder, renames it to ``step-<N>`` and replaces ``latest``. A folder without a
readable ``COMMIT`` is never loaded, and a failure on any rank raises on every rank, naming it.
Loading takes the checkpoint ``latest`` names if its files match the manifest's sizes and
CRC-32s, else the newest that does (with a warning naming what is damaged). Every file is read
with ``torch.load(weights_only=True)``: a file that would run code is refused. The folder must be
on a filesystem every rank sees (one machine, or a shared filesystem). With ``async_save`` the
writing happens in the background (:mod:`ups.ckpt.background`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import attrs
import structlog
import torch.distributed as dist

from ups.core import Loaded, RunContext, at_least, fsync_dir, write_atomically

from .errors import CheckpointError, agree, on_main
from .manifest import MANIFEST, Manifest
from .retention import prune
from .serialize import FileRecord, agree_safe, checksum, dump, load

log = structlog.get_logger()

T = TypeVar("T")

CHECKPOINTS = "checkpoints"
"""The folder, inside the run's folder, that holds the checkpoints."""
STATE_FILE = "state.pt"
LATEST_FILE = "latest"

_STEP_DIR = re.compile(r"step-(\d+)")


@attrs.frozen(kw_only=True)
class LocalCheckpointOptions:
    """Options of the ``local`` backend."""

    keep_last: int | None = attrs.field(default=3, validator=at_least(1))
    """How many of the newest committed checkpoints to keep; older ones are deleted after a
    save commits (``null``: keep all). The checkpoint ``latest`` names is never deleted."""
    keep_every: int | None = attrs.field(default=None, validator=at_least(1))
    """Also keep every checkpoint whose step is a multiple of this (``null``: none kept for it)."""
    async_save: bool = False
    """Write in the background: ``save`` returns once the state is copied, and training goes
    on while it is written and committed (one save in flight at a time)."""


@attrs.frozen
class Committed:
    """A committed checkpoint folder and its manifest."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


class LocalCheckpointer:
    """Keeps checkpoints as ``<run dir>/checkpoints/step-<N>/`` folders (see the module doc).

    ``group``: the process group its collectives use (``None``: the default one); a background
    saver gives it one of its own.
    """

    def __init__(
        self,
        *,
        ctx: RunContext,
        directory: Path,
        options: LocalCheckpointOptions,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.ctx = ctx
        self.folder = Path(directory) / CHECKPOINTS
        self.options = options
        self.group = group
        self._swept = False

    # -- the Checkpointer protocol ------------------------------------------------------------

    def save(self, state: Mapping[str, Any], *, step: int, rank_state: Mapping[str, Any]) -> str:
        """Save rank 0's ``state`` and every rank's ``rank_state`` as checkpoint ``step``.

        A collective: every rank calls it. Returns the committed folder's path on every rank.

        :raises CheckpointError: on every rank, naming the ranks that failed and why.
        :raises UnsafeCheckpointError: when a state holds what loading would refuse.
        """
        what = f"saving checkpoint step {step}"
        agree_safe(self.ctx, what, step=step, state=state, rank_state=rank_state, group=self.group)
        tmp = Path(self._on_main(what, lambda: str(self._begin(step))))
        error: Exception | None = None
        written: dict[str, FileRecord] = {}
        try:
            written = self._write_state(tmp, state)
            _write(tmp / _rank_file(self.ctx.rank), rank_state)
        except Exception as caught:  # every rank learns of it below
            error = caught
        try:
            agree(self.ctx, what, error, self.group)
        except CheckpointError:
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self._on_main(what, lambda: self._commit(tmp, step, written))

    def load_latest(self) -> Loaded | None:
        """Load the checkpoint ``latest`` names, else the newest committed one that verifies,
        on every rank; ``None`` when there is none.

        :raises CheckpointError: on every rank, when any rank cannot read it.
        :raises UnsafeCheckpointError: when a file would run code to load (on every rank).
        """
        found = self._on_main("finding the latest checkpoint", self._find_latest)
        if found is None:
            return None
        path_text, step, saved_world = found
        path = Path(path_text)
        state: dict[str, Any] = {}
        own: dict[str, Any] | None = None
        error: Exception | None = None
        try:
            state = self._read_state(path)
            if saved_world == self.ctx.world_size:
                own = _read(path / _rank_file(self.ctx.rank))
        except Exception as caught:  # every rank learns of it below
            error = caught
        agree(self.ctx, f"loading checkpoint {path}", error, self.group)
        return Loaded(step=step, state=state, rank_state=own, location=str(path))

    def wait(self) -> None:
        """Nothing to wait for: :meth:`save` returns once the checkpoint is committed."""

    def location(self, step: int) -> str:
        """Where checkpoint ``step`` goes once committed."""
        return str(self.folder / f"step-{step}")

    def committed(self) -> list[Committed]:
        """The committed checkpoints in the folder, oldest step first (read on this rank)."""
        found = []
        for path in self.folder.glob("step-*"):
            if _STEP_DIR.fullmatch(path.name) and path.is_dir():
                manifest = _read_manifest(path)
                if manifest is not None:
                    found.append(Committed(path, manifest))
        return sorted(found, key=lambda c: c.step)

    # -- how the replicated state is kept (a subclass may keep it otherwise) -------------------

    def _write_state(self, tmp: Path, state: Mapping[str, Any]) -> dict[str, FileRecord]:
        """Write the replicated ``state`` into the folder ``tmp``; return the records of the
        files written (rank 0's return is used; files it does not name are read back at commit).

        Every rank calls it, before anything that may fail on one rank only, so a subclass may
        run collectives over ``self.group`` in it. Here rank 0 writes ``state.pt``.
        """
        if not self.ctx.is_main:
            return {}
        return {STATE_FILE: _write(tmp / STATE_FILE, state)}

    def _read_state(self, path: Path) -> dict[str, Any]:
        """Read the replicated state of the committed checkpoint folder ``path``.

        Every rank calls it, first, so a subclass may run collectives over ``self.group`` in it.
        """
        return _read(path / STATE_FILE)

    # -- rank 0's parts -----------------------------------------------------------------------

    def _on_main(self, what: str, action: Callable[[], T]) -> T:
        return on_main(self.ctx, what, action, self.group)

    def _begin(self, step: int) -> Path:
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.folder.parent)
        if not self._swept:  # what earlier runs left: no save of this run is in flight yet
            self._swept = True
            for pattern in (".tmp-step-*", ".trash-*", f".{LATEST_FILE}-*"):
                for left in self.folder.glob(pattern):
                    if left.is_dir():
                        shutil.rmtree(left, ignore_errors=True)
                    else:
                        left.unlink(missing_ok=True)
        while True:
            tmp = self.folder / f".tmp-step-{step}-{secrets.token_hex(4)}"
            try:
                tmp.mkdir()
            except FileExistsError:
                continue
            return tmp

    def _commit(self, tmp: Path, step: int, written: dict[str, FileRecord]) -> str:
        """Write the manifest (``written``: the records of the files rank 0 wrote; the other
        ranks' files are read back for theirs), rename, point ``latest`` at it, retain."""
        final = self.folder / f"step-{step}"
        try:
            for rank in range(self.ctx.world_size):
                name = _rank_file(rank)
                if not (tmp / name).is_file():
                    raise CheckpointError(
                        f"{tmp / name} is missing although rank {rank} wrote it: is "
                        f"{self.folder} on a filesystem every rank shares?"
                    )
            files = dict(written)
            for path in sorted(tmp.rglob("*")):
                name = path.relative_to(tmp).as_posix()
                if path.is_file() and name not in files:
                    with open(path, "rb") as file:
                        files[name] = checksum(file)
            manifest = Manifest(
                step=step,
                world_size=self.ctx.world_size,
                files=files,
                saved_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            )
            _write_new(tmp / MANIFEST, manifest.to_json())
            fsync_dir(tmp)
            if final.exists():
                # Saving a step again (after resuming): the new checkpoint replaces the old.
                _remove(final, self.folder)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.folder)
        write_atomically(self.folder / LATEST_FILE, final.name + "\n")
        self._retain(protect=step)
        return str(final)

    def _retain(self, protect: int) -> None:
        prune(
            {c.step: str(c.path) for c in self.committed()},
            lambda path: _remove(Path(path), self.folder),
            keep_last=self.options.keep_last,
            keep_every=self.options.keep_every,
            protected=protect,
        )

    def _find_latest(self) -> tuple[str, int, int] | None:
        """The checkpoint ``latest`` names, else the newest committed one, if it verifies;
        else the newest that does, with a warning naming each damaged one skipped."""
        committed = self.committed()
        pointer = _read_latest(self.folder)
        named = [c for c in committed if c.path.name == pointer]
        if pointer is not None and not named and committed:
            log.warning("'latest' names no committed checkpoint", latest=pointer)
        for candidate in named + [c for c in reversed(committed) if c not in named]:
            damage = _damage(candidate)
            if damage is None:
                return str(candidate.path), candidate.step, candidate.manifest.world_size
            log.warning(
                "damaged checkpoint skipped: loading an older one",
                checkpoint=str(candidate.path),
                damage=damage,
            )
        if committed:
            raise CheckpointError(
                f"no checkpoint in {self.folder} verifies against its COMMIT manifest "
                f"({len(committed)} damaged); move them away to start afresh"
            )
        return None


def _damage(checkpoint: Committed) -> str | None:
    """What is wrong with a committed checkpoint's files (``None``: they match the manifest)."""
    for name, record in checkpoint.manifest.files.items():
        path = checkpoint.path / name
        try:
            with open(path, "rb") as file:
                found = checksum(file)
        except FileNotFoundError:
            return f"{path} is missing"
        if found != record:
            return (
                f"{path} has {found.size} bytes, CRC-32 {found.crc32:08x}; COMMIT says "
                f"{record.size} bytes, CRC-32 {record.crc32:08x}"
            )
    return None


# ---------------------------------------------------------------------------------------------
# Files


def _rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def _write(path: Path, obj: Mapping[str, Any]) -> FileRecord:
    """Save ``obj`` into a new file and fsync it."""
    with open(path, "xb") as file:
        record = dump(dict(obj), file)
        file.flush()
        os.fsync(file.fileno())
    return record


def _read(path: Path) -> dict[str, Any]:
    with open(path, "rb") as file:
        return load(file, str(path))


def _read_manifest(path: Path) -> Manifest | None:
    """The manifest of a checkpoint folder, or ``None`` when it is not committed."""
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    try:
        manifest = Manifest.from_json(text)
    except ValueError as error:
        log.warning("unreadable COMMIT; checkpoint ignored", checkpoint=str(path), error=str(error))
        return None
    if f"step-{manifest.step}" != path.name:
        log.warning(
            "COMMIT names another step; checkpoint ignored",
            checkpoint=str(path),
            step=manifest.step,
        )
        return None
    return manifest


def _read_latest(folder: Path) -> str | None:
    try:
        name = (folder / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return name if _STEP_DIR.fullmatch(name) else None


def _write_new(path: Path, text: str) -> None:
    """Write ``text`` durably into a file that must not exist yet."""
    with open(path, "x") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    fsync_dir(path.parent)


def _remove(path: Path, folder: Path) -> None:
    """Delete a checkpoint folder: first rename it out of sight, so it never looks committed
    while half deleted."""
    trash = folder / f".trash-{path.name}-{secrets.token_hex(4)}"
    os.rename(path, trash)
    shutil.rmtree(trash)
