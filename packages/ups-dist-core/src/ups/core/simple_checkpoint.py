"""The built-in ``simple`` checkpoint backend: one folder per checkpoint, committed atomically.

It is the commit protocol (:mod:`ups.core.commit`) over a folder; ups-ckpt's ``local`` backend
is this folder with more options. Layout under the run's folder::

    checkpoints/
        step-100/           a committed checkpoint
            state.pt        the replicated state, written by rank 0
            rank-0.pt       what each rank keeps of its own (its RNG state)
            rank-1.pt
            COMMIT          the manifest, written last: step, world size, files, sizes, CRC-32s
        latest              the name of the newest checkpoint ("step-100"), replaced atomically
        .tmp-step-150-1f2e  a save in progress, or one that crashed: never loaded

Every rank's own state is gathered to rank 0, which alone writes: it makes the temporary
folder, writes and fsyncs every file there, writes ``COMMIT``, fsyncs the folder, renames it to
``step-<N>`` and replaces ``latest``; so saving needs the folder on rank 0's machine only.
Loading needs it on every rank's (one machine, or a shared filesystem). A folder of the
one-file layout of earlier versions (``step-000000100.pt``) is refused, naming such a file.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .builtins import CHECKPOINTS, SimpleCheckpointOptions
from .checkpoint_errors import CheckpointError
from .commit import COMMIT_FILE, LATEST_FILE, Committing, rank_file
from .context import RunContext
from .files import fsync_dir, write_atomically
from .serialize import FileRecord, checksum, dump, load


class SimpleCheckpointer(Committing[Path]):
    """Keeps checkpoints as ``<run dir>/checkpoints/step-<N>/`` folders (see the module doc).

    ``group``: the process group its collectives use (``None``: the default one).
    """

    gathers_rank_states = True

    def __init__(
        self,
        *,
        ctx: RunContext,
        directory: Path,
        options: SimpleCheckpointOptions,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.folder = Path(directory) / CHECKPOINTS
        keep_last, keep_every = options.keep_last, options.keep_every
        super().__init__(
            ctx, group, "", f"in {self.folder}", keep_last=keep_last, keep_every=keep_every
        )
        self.options = options
        self._swept = False

    # -- the folder ---------------------------------------------------------------------------

    def _begin(self, step: int) -> Path:
        self._refuse_one_file_layout()
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

    def _checksum(self, where: Path, name: str) -> FileRecord:
        with open(where / name, "rb") as file:
            return checksum(file)

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
                files[name] = self._checksum(staged, name)
        return files

    def _write_manifest(self, staged: Path, text: str) -> None:
        _write_new(staged / COMMIT_FILE, text)
        fsync_dir(staged)

    def _publish(self, staged: Path, step: int) -> Path:
        final = self._named(f"step-{step}")
        if final.exists():
            # Saving a step again (after resuming): the new checkpoint replaces the old.
            _remove(final, self.folder)
        os.rename(staged, final)
        fsync_dir(self.folder)
        return final

    def _point_latest(self, name: str) -> None:
        write_atomically(self.folder / LATEST_FILE, name + "\n")

    def _read_latest(self) -> str | None:
        try:
            return (self.folder / LATEST_FILE).read_text()
        except FileNotFoundError:
            return None

    def _listed(self) -> dict[str, Path]:
        self._refuse_one_file_layout()
        return {path.name: path for path in self.folder.glob("step-*") if path.is_dir()}

    def _read_manifest(self, where: Path) -> str | None:
        try:
            return (where / COMMIT_FILE).read_text()
        except FileNotFoundError:
            return None

    def _remove(self, where: Path) -> None:
        _remove(where, self.folder)

    def _named(self, name: str) -> Path:
        return self.folder / name

    def _location_of(self, where: Path) -> str:
        return str(where)

    def _refuse_one_file_layout(self) -> None:
        """Refuse the folder of a run that earlier versions' ``simple`` backend saved in."""
        old = next(self.folder.glob("step-*.pt"), None)
        if old is not None:
            raise CheckpointError(
                f"{old} is a checkpoint in the one-file layout of an earlier ups-dist-core, "
                "which this version neither loads nor saves beside: move it away, or resume "
                "with that version"
            )


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
