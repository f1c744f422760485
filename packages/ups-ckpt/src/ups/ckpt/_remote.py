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
gathered to rank 0, which checks that the store has every file at its size, writes
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
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any

import attrs
import structlog
import torch.distributed as dist

from ups.core import COMMIT_FILE, Committing, FileRecord, RunContext, dump

from ._local import LocalCheckpointOptions
from ._store import filesystem, store_url

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


class FsspecStorage:
    """A :class:`~ups.core.CheckpointStorage` under a URL, through fsspec: ``<url>/step-<N>/``,
    written where it stays and committed by its ``COMMIT`` (see the module doc); a pointer is
    the object ``<url>/<name>``.

    :param fs: fsspec's filesystem, and ``root``, the URL's path on it (:func:`filesystem`).
    :param url: the URL, as locations and messages name it.
    """

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs, self.root, self.url = fs, root, url
        self._swept = False

    def stage(self, step: int) -> str:
        """Clear the way for checkpoint ``step-<step>``, written where it stays: delete an
        older one of that step, and, at this storage's first save, the uncommitted prefixes
        earlier runs left."""
        name = f"step-{step}"
        prefixes = self.checkpoints()
        if not self._swept:  # no save of this storage is in flight yet
            self._swept = True
            for left in prefixes:
                if left != name and not self.fs.exists(self._path(f"{left}/{COMMIT_FILE}")):
                    log.info("uncommitted checkpoint deleted", checkpoint=self.location(left))
                    self.fs.rm(self._path(left), recursive=True)
        if name in prefixes:
            self.remove(name)
        return name

    def write(self, key: str, file: str, obj: Mapping[str, Any]) -> FileRecord:
        with self.fs.open(self._path(f"{key}/{file}"), "wb") as stream:
            return dump(dict(obj), stream)

    def read(self, key: str, file: str) -> AbstractContextManager[IO[bytes]]:
        self.fs.invalidate_cache()  # sizes listed before this checkpoint was written
        stream: AbstractContextManager[IO[bytes]] = self.fs.open(self._path(f"{key}/{file}"), "rb")
        return stream

    def commit(self, key: str, step: int, manifest: str) -> None:
        """Write ``COMMIT``: the checkpoint is written where it stays (``stage`` named it
        ``step-<step>``), and its ``COMMIT`` commits it."""
        self.fs.pipe_file(self._path(f"{key}/{COMMIT_FILE}"), manifest.encode())

    def checkpoints(self) -> list[str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:  # nothing saved yet
            return []
        return [_basename(entry["name"]) for entry in entries if entry["type"] == "directory"]

    def remove(self, key: str) -> None:
        """Delete checkpoint ``key``: ``COMMIT`` first, so it never looks committed while half
        deleted, then the rest."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(f"{key}/{COMMIT_FILE}"))
        self.fs.rm(self._path(key), recursive=True)

    def set_pointer(self, name: str, key: str) -> None:
        self.fs.pipe_file(self._path(name), f"{key}\n".encode())

    def read_pointer(self, name: str) -> str | None:
        try:
            text: str = self.fs.cat_file(self._path(name)).decode(errors="replace")
        except FileNotFoundError:
            return None
        return text

    def location(self, key: str, file: str | None = None) -> str:
        return f"{self.url}/{key}" if file is None else f"{self.url}/{key}/{file}"

    def _path(self, relative: str) -> str:
        """The filesystem's path of ``relative`` (to the URL)."""
        return f"{self.root}/{relative}"


class FsspecCheckpointer(Committing):
    """Keeps checkpoints as ``<url>/step-<N>/`` prefixes through fsspec (see the module doc):
    the commit protocol's :class:`~ups.core.Committing` over an :class:`FsspecStorage`.

    ``directory``: the run's folder, which a relative local path is taken relative to.
    ``group``: the process group its collectives use (``None``: the default one); a background
    saver gives it one of its own.

    :raises ConfigError: when fsspec, or the filesystem the URL needs, is not installed.
    """

    storage: FsspecStorage

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
            FsspecStorage(*filesystem(url, options.storage_options), url),
            where=f"under {url}",
            place=f" under {url}",
            group=group,
            keep_last=options.keep_last,
            keep_every=options.keep_every,
            keep_best=options.keep_best,
        )
        self.options = options
        self.url = url
        """The URL the checkpoints are under, as locations and messages name them."""


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
