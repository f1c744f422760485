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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch.distributed as dist

from ups.core import RunContext, at_least, fsync_dir, write_atomically

from ._latest import newest_verified
from ._protocol import Committing, rank_file
from .errors import CheckpointError
from .manifest import MANIFEST, Manifest, read_committed
from .retention import prune
from .serialize import FileRecord, checksum, dump, load

log = structlog.get_logger()


CHECKPOINTS = "checkpoints"
"""The folder, inside the run's folder, that holds the checkpoints."""
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


class LocalCheckpointer(Committing[Path]):
    """Keeps checkpoints as ``<run dir>/checkpoints/step-<N>/`` folders (see the module doc):
    the commit protocol of :class:`~ups.ckpt._protocol.Committing` over a folder.

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
        super().__init__(ctx, group, place="")
        self.folder = Path(directory) / CHECKPOINTS
        self.options = options
        self._swept = False

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

    # -- the folder ---------------------------------------------------------------------------

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

    def _put(self, where: Path, name: str, obj: Mapping[str, Any]) -> FileRecord:
        return _write(where / name, obj)

    def _get(self, where: Path, name: str) -> dict[str, Any]:
        return _read(where / name)

    def _discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def _verify(self, staged: Path, files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """Every rank's file is there (a rank's file missing: the folder is not shared); the
        files no rank recorded are read back for their records."""
        for rank in range(self.ctx.world_size):
            name = rank_file(rank)
            if not (staged / name).is_file():
                raise CheckpointError(
                    f"{staged / name} is missing although rank {rank} wrote it: is "
                    f"{self.folder} on a filesystem every rank shares?"
                )
        files = dict(files)
        for path in sorted(staged.rglob("*")):
            name = path.relative_to(staged).as_posix()
            if path.is_file() and name not in files:
                with open(path, "rb") as file:
                    files[name] = checksum(file)
        return files

    def _write_manifest(self, staged: Path, manifest: Manifest) -> None:
        _write_new(staged / MANIFEST, manifest.to_json())
        fsync_dir(staged)

    def _publish(self, staged: Path, step: int) -> Path:
        final = self.folder / f"step-{step}"
        if final.exists():
            # Saving a step again (after resuming): the new checkpoint replaces the old.
            _remove(final, self.folder)
        os.rename(staged, final)
        fsync_dir(self.folder)
        return final

    def _point_latest(self, where: Path) -> None:
        write_atomically(self.folder / LATEST_FILE, where.name + "\n")

    def _retain(self, protect: int) -> None:
        prune(
            {c.step: str(c.path) for c in self.committed()},
            lambda path: _remove(Path(path), self.folder),
            keep_last=self.options.keep_last,
            keep_every=self.options.keep_every,
            protected=protect,
        )

    def _find_latest(self) -> tuple[Path, int, int] | None:
        pointer = _read_latest(self.folder)
        found = newest_verified(
            self.committed(),
            latest=None if pointer is None else str(self.folder / pointer),
            location=lambda c: str(c.path),
            damage=_damage,
            where=f"in {self.folder}",
        )
        return None if found is None else (found.path, found.step, found.manifest.world_size)

    def _location_of(self, where: Path) -> str:
        return str(where)


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
        text: str | None = (path / MANIFEST).read_text()
    except FileNotFoundError:
        text = None
    return read_committed(text, path.name, str(path))


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
