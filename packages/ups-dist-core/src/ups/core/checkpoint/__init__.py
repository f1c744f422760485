"""Checkpoints, for storage and backend authors: the commit protocol (``Committing``, composed with
a ``CheckpointStorage``), its files (``Manifest``, ``FileRecord``, ``dump``, ``load``), retention
(``expired``), the built-in ``simple`` backend (``SimpleCheckpointer`` over ``FolderStorage``),
crash-safe file writes and the errors every rank agrees on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ..plugin._builtins import SimpleCheckpointOptions, probe_checkpoints
    from ._commit import COMMIT_FILE, LATEST_FILE, CheckpointStorage, Committed, Committing
    from ._errors import CheckpointError, DiskFullError, UnsafeCheckpointError
    from ._files import check_writable, fsync_dir, write_atomically
    from ._manifest import Manifest
    from ._retention import expired
    from ._serialize import FileRecord, checksum, dump, load
    from ._simple import FolderStorage, SimpleCheckpointer

_EXPORTS = {
    "CheckpointError": "._errors",
    "DiskFullError": "._errors",
    "UnsafeCheckpointError": "._errors",
    "COMMIT_FILE": "._commit",
    "LATEST_FILE": "._commit",
    "CheckpointStorage": "._commit",
    "Committed": "._commit",
    "Committing": "._commit",
    "Manifest": "._manifest",
    "expired": "._retention",
    "FileRecord": "._serialize",
    "checksum": "._serialize",
    "dump": "._serialize",
    "load": "._serialize",
    "check_writable": "._files",
    "fsync_dir": "._files",
    "write_atomically": "._files",
    "FolderStorage": "._simple",
    "SimpleCheckpointer": "._simple",
    "SimpleCheckpointOptions": "..plugin._builtins",
    "probe_checkpoints": "..plugin._builtins",
}
"""Each public name and the module that defines it."""

__all__ = [
    "check_writable",
    "CheckpointError",
    "CheckpointStorage",
    "checksum",
    "COMMIT_FILE",
    "Committed",
    "Committing",
    "DiskFullError",
    "dump",
    "expired",
    "FileRecord",
    "FolderStorage",
    "fsync_dir",
    "LATEST_FILE",
    "load",
    "Manifest",
    "probe_checkpoints",
    "SimpleCheckpointer",
    "SimpleCheckpointOptions",
    "UnsafeCheckpointError",
    "write_atomically",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
