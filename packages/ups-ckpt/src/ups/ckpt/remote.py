"""The ``fsspec`` checkpoint backend: checkpoints in an object store or on any filesystem that
fsspec reaches (S3 through s3fs, GCS through gcsfs, Azure through adlfs, a local path).

Layout under the configured URL, e.g. ``s3://bucket/run1/checkpoints``::

    step-100/          a committed checkpoint (a prefix in an object store, a folder on disk)
        state.pt       the replicated state, written by rank 0
        rank-0.pt      what each rank keeps of its own (its RNG state)
        rank-1.pt
        COMMIT         the manifest, written last: step, world size, files, sizes, CRC-32s
    latest             the name of the newest checkpoint ("step-100")
    step-150/          a save in progress, or one that crashed: no COMMIT, never loaded

An object store has no rename, so a checkpoint is written where it stays and is committed by
its ``COMMIT`` object. A save is a collective every rank enters: all ranks learn whether the
state is safe to save; rank 0 prepares the prefix; every rank uploads its files, computing
their sizes and CRC-32s as the bytes go out; all ranks learn whether any rank failed (if one
did, every rank raises, naming it, and the prefix is deleted); the other ranks' records are
gathered to rank 0, which checks that the store lists every file at its size, writes
``COMMIT``, then ``latest``, then deletes what retention lets go. A prefix without a readable
``COMMIT`` is never loaded; the first save of a checkpointer deletes those left by earlier runs.

A checkpoint's prefix is ``step-<N>``, without a random suffix, so that :meth:`location` knows
it before the save (saving in the background returns it at once). Saving a step that is there
already (after resuming from an older checkpoint) first deletes the old one, ``COMMIT`` first:
until the new one commits that step is absent, and loading takes the newest other one. Every
deletion (retention, a step saved again) removes ``COMMIT`` first, so that a checkpoint half
deleted never looks committed; retention never deletes the checkpoint ``latest`` names.

Loading takes the checkpoint ``latest`` names if every file matches the manifest's size and
CRC-32, else the newest committed one that does, with a warning naming each damaged one
skipped. Every file is read with ``torch.load(weights_only=True)``: a file that would run code
is refused. ``storage_options`` go to the filesystem as they are and are never logged; keys
and secrets belong in the environment (s3fs reads ``AWS_*`` like every AWS client).

On a local path fsspec neither fsyncs nor renames: the ``local`` backend is the crash-safe
choice there; this one takes local paths for tests and for filesystems mounted by a driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch.distributed as dist

from ups.core import (
    COMMIT_FILE,
    LATEST_FILE,
    CheckpointError,
    Committing,
    FileRecord,
    RunContext,
    checksum,
    dump,
    load,
)

from ._store import filesystem, store_url
from .local import LocalCheckpointOptions

log = structlog.get_logger()


def _url_given(_instance: object, _attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.strip("/ "):
        raise ValueError("give the URL or path to keep checkpoints under")


def _keys_only(options: dict[str, Any]) -> str:
    """The repr of ``storage_options``: their keys, never their values (they may be secrets)."""
    return f"<storage options: {', '.join(sorted(options)) or 'none'}>"


@attrs.frozen(kw_only=True)
class FsspecCheckpointOptions(LocalCheckpointOptions):
    """Options of the ``fsspec`` backend: those of ``local``, and where to keep them."""

    url: str = attrs.field(validator=_url_given)
    """Where the checkpoints go: ``s3://bucket/run1/checkpoints``, ``gs://...``, ``az://...``,
    ``file:///...`` or a path; a relative path is relative to the run's folder."""
    storage_options: dict[str, Any] = attrs.field(factory=dict, repr=_keys_only)
    """Passed to the filesystem as they are (s3fs: ``endpoint_url``, ``client_kwargs``, ...);
    never logged. Keys and secrets belong in the environment (``AWS_ACCESS_KEY_ID``, ...)."""


class FsspecCheckpointer(Committing[str]):
    """Keeps checkpoints as ``<url>/step-<N>/`` prefixes through fsspec (see the module doc):
    the commit protocol of :class:`~ups.core.Committing` over a store without rename.

    ``directory``: the run's folder, which a relative local path is taken relative to.
    ``group``: the process group its collectives use (``None``: the default one); a background
    saver gives it one of its own.

    :raises ConfigError: when fsspec, or the filesystem the URL needs, is not installed.
    """

    def __init__(
        self,
        *,
        ctx: RunContext,
        directory: Path,
        options: FsspecCheckpointOptions,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        url = store_url(options.url, directory)
        super().__init__(
            ctx,
            group,
            f" under {url}",
            f"under {url}",
            keep_last=options.keep_last,
            keep_every=options.keep_every,
        )
        self.options = options
        self.url = url
        """The URL the checkpoints are under, as locations and messages name them."""
        self.fs, self.root = filesystem(url, options.storage_options)
        self._swept = False

    # -- the store ----------------------------------------------------------------------------

    def _begin(self, step: int) -> str:
        """Clear the way for checkpoint ``step-<step>``, written where it stays: delete an
        older one of that step, and, at this checkpointer's first save, the uncommitted
        prefixes earlier runs left."""
        name = f"step-{step}"
        prefixes = self._published()
        if not self._swept:  # no save of this checkpointer is in flight yet
            self._swept = True
            for left in prefixes:
                if left != name and not self.fs.exists(self._path(f"{left}/{COMMIT_FILE}")):
                    log.info("uncommitted checkpoint deleted", checkpoint=self._url(left))
                    self.fs.rm(self._path(left), recursive=True)
        if name in prefixes:
            self._remove(name)
        return name

    def _put(self, where: str, name: str, obj: Mapping[str, Any]) -> FileRecord:
        with self.fs.open(self._path(f"{where}/{name}"), "wb") as file:
            return dump(dict(obj), file)

    def _get(self, where: str, name: str) -> dict[str, Any]:
        self.fs.invalidate_cache()  # sizes listed before this checkpoint was written
        with self.fs.open(self._path(f"{where}/{name}"), "rb") as file:
            return load(file, self._url(f"{where}/{name}"))

    def _checksum(self, where: str, name: str) -> FileRecord:
        with self.fs.open(self._path(f"{where}/{name}"), "rb") as file:
            return checksum(file)

    def _discard(self, staged: str) -> None:
        """Delete what a failed save wrote, if it can (a prefix left uncommitted is harmless)."""
        try:
            self.fs.invalidate_cache()
            if self.fs.exists(self._path(staged)):
                self._remove(staged)
        except Exception as error:  # the next checkpointer's first save deletes it
            log.warning(
                "could not delete a failed save",
                checkpoint=self._url(staged),
                error=f"{type(error).__name__}: {error}",
            )

    def _verify(self, staged: str, files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """The store lists every file at its recorded size."""
        self.fs.invalidate_cache()
        listed = {
            _basename(entry["name"]): entry["size"]
            for entry in self.fs.ls(self._path(staged), detail=True)
        }
        for file, record in sorted(files.items()):
            if listed.get(file) != record.size:
                raise CheckpointError(
                    f"{self._url(f'{staged}/{file}')} is not there with the {record.size} "
                    f"bytes written (found: {listed.get(file)}): does every rank reach the "
                    "same store?"
                )
        return files

    def _write_manifest(self, staged: str, text: str) -> None:
        self.fs.pipe_file(self._path(f"{staged}/{COMMIT_FILE}"), text.encode())

    def _publish(self, staged: str, step: int) -> str:
        return staged  # written where it stays: its COMMIT commits it

    def _point_latest(self, name: str) -> None:
        self.fs.pipe_file(self._path(LATEST_FILE), f"{name}\n".encode())

    def _read_latest(self) -> str | None:
        try:
            text: str = self.fs.cat_file(self._path(LATEST_FILE)).decode(errors="replace")
        except FileNotFoundError:
            return None
        return text

    def _named(self, name: str) -> str:
        return name

    def _location_of(self, where: str) -> str:
        return self._url(where)

    def _path(self, relative: str) -> str:
        """The filesystem's path of ``relative`` (to the URL)."""
        return f"{self.root}/{relative}"

    def _url(self, relative: str) -> str:
        """The URL of ``relative`` (to the URL), as locations and messages name it."""
        return f"{self.url}/{relative}"

    def _listed(self) -> dict[str, str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:  # nothing saved yet
            return {}
        names = (_basename(entry["name"]) for entry in entries if entry["type"] == "directory")
        return {name: name for name in names}

    def _read_manifest(self, where: str) -> str | None:
        try:
            text: str = self.fs.cat_file(self._path(f"{where}/{COMMIT_FILE}")).decode()
        except FileNotFoundError:
            return None
        return text

    def _remove(self, name: str) -> None:
        """Delete checkpoint ``name``: ``COMMIT`` first, so it never looks committed while
        half deleted, then the rest."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(f"{name}/{COMMIT_FILE}"))
        self.fs.rm(self._path(name), recursive=True)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
