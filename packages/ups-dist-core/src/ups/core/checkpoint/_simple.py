"""The built-in ``simple`` checkpoint backend: one folder per checkpoint, committed atomically.

It is the commit protocol (:mod:`ups.core.checkpoint._commit`) over a folder, :class:`FolderStorage`;
ups-ckpt's ``local`` and ``sharded`` backends are this folder with more options. Layout under
the run's folder::

    checkpoints/
        step-100/           a committed checkpoint
            state.pt        the replicated state, written by rank 0
            rank-0.pt       what each rank keeps of its own (its RNG state)
            rank-1.pt
            COMMIT          the manifest, written last: step, world size, files, sizes, CRC-32s
        latest              the name of the newest checkpoint ("step-100"), replaced atomically
        .tmp-step-150-1f2e3d4c  a save in progress, or one that crashed: never loaded

Every rank's own state is gathered to rank 0, which alone writes: it makes the temporary
folder, writes and fsyncs every file there, writes ``COMMIT``, fsyncs the folder, renames it to
``step-<N>`` and replaces ``latest``; so saving needs the folder on rank 0's machine only.
Loading needs it on every rank's (one machine, or a shared filesystem). A folder of the
one-file layout of earlier versions (``step-000000100.pt``) is refused, naming such a file.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch.distributed as dist

from ..dist._context import RunContext
from ..plugin._builtins import CHECKPOINTS, SimpleCheckpointOptions
from ._commit import COMMIT_FILE, Committing, step_key
from ._errors import CheckpointError
from ._files import fsync_dir, write_atomically
from ._serialize import FileRecord, dump

WriteFile = Callable[[Path, Mapping[str, Any]], FileRecord]
"""How :class:`FolderStorage` writes a file of a checkpoint: ``(path, state) -> its record``."""

_LEFT = re.compile(r"\.tmp-step-\d+-[0-9a-f]{8}|\.trash-.+|\.[^.]+-[0-9a-f]{8}")
"""What a save in flight keeps beside the checkpoints, and a crash may leave: a staged
checkpoint, one being deleted, a pointer's new content (``.latest-1f2e3d4c``)."""


class FolderStorage:
    """A :class:`~ups.core.CheckpointStorage` in a folder: ``<folder>/step-<N>/``, staged in a
    temporary folder beside it and renamed into place; a pointer is the file ``<folder>/<name>``
    (see the module doc).

    :param folder: where the checkpoints are (made at the first save when missing).
    :param write_file: writes each file of a checkpoint but ``COMMIT``: given the new file's
        path and the mapping to save, it saves it, fsyncs it and returns its record. The
        default does; a test gives another (or sets :attr:`write_file` on a built storage,
        ``checkpointer.storage.write_file = ...``) to make a write fail, stall or stop part way.
    """

    def __init__(self, folder: Path, *, write_file: WriteFile | None = None) -> None:
        self.folder = Path(folder)
        self.write_file: WriteFile = write_file or _write
        """Writes each file of a checkpoint but ``COMMIT`` (see ``write_file`` above)."""
        self._swept = False

    def path(self, key: str) -> Path:
        """The folder of the checkpoint ``key``."""
        return self.folder / key

    def stage(self, step: int) -> str:
        self._refuse_one_file_layout()
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.folder.parent)
        if not self._swept:  # what earlier runs left: no save of this storage is in flight yet
            self._swept = True
            for left in self.folder.glob(".*-*"):
                if _LEFT.fullmatch(left.name) and left.is_dir():
                    shutil.rmtree(left, ignore_errors=True)
                elif _LEFT.fullmatch(left.name):
                    left.unlink(missing_ok=True)
        while True:
            key = f".tmp-step-{step}-{secrets.token_hex(4)}"
            try:
                self.path(key).mkdir()
            except FileExistsError:
                continue
            return key

    def write(self, key: str, file: str, obj: Mapping[str, Any]) -> FileRecord:
        return self.write_file(self.path(key) / file, obj)

    def read(self, key: str, file: str) -> BinaryIO:
        return open(self.path(key) / file, "rb")

    def commit(self, key: str, step: int, manifest: str) -> None:
        """Write ``COMMIT``, fsync the staged folder, rename it to ``step-<step>`` (deleting
        an older one of that step first) and fsync the folder."""
        staged = self.path(key)
        _write_new(staged / COMMIT_FILE, manifest)
        final = self.path(step_key(step))
        if final.exists():
            # Saving a step again (after resuming): the new checkpoint replaces the old.
            _remove(final, self.folder)
        os.rename(staged, final)
        fsync_dir(self.folder)

    def checkpoints(self) -> list[str]:
        self._refuse_one_file_layout()
        return [path.name for path in self.folder.glob("step-*") if path.is_dir()]

    def remove(self, key: str) -> None:
        _remove(self.path(key), self.folder)

    def set_pointer(self, name: str, key: str) -> None:
        write_atomically(self.folder / name, key + "\n")

    def read_pointer(self, name: str) -> str | None:
        try:
            return (self.folder / name).read_text()
        except FileNotFoundError:
            return None

    def location(self, key: str, file: str | None = None) -> str:
        return str(self.path(key) if file is None else self.path(key) / file)

    def _refuse_one_file_layout(self) -> None:
        """Refuse the folder of a run that earlier versions' ``simple`` backend saved in."""
        old = next(self.folder.glob("step-*.pt"), None)
        if old is not None:
            raise CheckpointError(
                f"{old} is a checkpoint in the one-file layout of an earlier ups-dist-core, "
                "which this version neither loads nor saves beside: move it away, or resume "
                "with that version"
            )


class SimpleCheckpointer(Committing):
    """Keeps checkpoints as ``<run dir>/checkpoints/step-<N>/`` folders (see the module doc):
    the commit protocol's :class:`~ups.core.Committing` over a :class:`FolderStorage`.

    ``group``: the process group its collectives use (``None``: the default one).
    """

    gathers_rank_states = True
    storage: FolderStorage

    def __init__(
        self,
        *,
        ctx: RunContext,
        directory: Path,
        options: SimpleCheckpointOptions,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.folder = Path(directory) / CHECKPOINTS
        super().__init__(
            ctx,
            FolderStorage(self.folder),
            where=f"in {self.folder}",
            group=group,
            keep_last=options.keep_last,
            keep_every=options.keep_every,
            keep_best=options.keep_best,
        )
        self.options = options


# ---------------------------------------------------------------------------------------------
# Files


def _write(path: Path, obj: Mapping[str, Any]) -> FileRecord:
    """Save ``obj`` into a new file and fsync it."""
    with open(path, "xb") as file:
        record = dump(dict(obj), file)
        file.flush()
        os.fsync(file.fileno())
    return record


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
