"""ups-ckpt: checkpoint backends for ups.

``local`` keeps each checkpoint as a folder of files written by every rank and committed
atomically (a ``COMMIT`` manifest with each file's size and CRC-32, a rename, a ``latest``
pointer); see :mod:`ups.ckpt.local`. Select it in the config with
``checkpoint: {name: local, options: {keep_last: 3}}``; ``async_save: true`` writes in the
background (:mod:`ups.ckpt.background`).

In a loop of one's own, :func:`checkpointer` builds one from a folder or URL and options (see
docs/own-loop.md).
"""

from typing import TYPE_CHECKING

from ups.core import lazy_exports

if TYPE_CHECKING:
    from ._by_path import checkpointer
    from .background import InBackground, Stager, stage
    from .errors import CheckpointError, UnsafeCheckpointError
    from .local import Committed, LocalCheckpointer, LocalCheckpointOptions
    from .manifest import Manifest
    from .remote import FsspecCheckpointer, FsspecCheckpointOptions
    from .retention import expired
    from .serialize import FileRecord
    from .sharded import ShardedCheckpointer

_EXPORTS = {
    "checkpointer": "._by_path",
    "InBackground": ".background",
    "Stager": ".background",
    "stage": ".background",
    "CheckpointError": ".errors",
    "UnsafeCheckpointError": ".errors",
    "Committed": ".local",
    "LocalCheckpointer": ".local",
    "LocalCheckpointOptions": ".local",
    "Manifest": ".manifest",
    "FsspecCheckpointer": ".remote",
    "FsspecCheckpointOptions": ".remote",
    "expired": ".retention",
    "FileRecord": ".serialize",
    "ShardedCheckpointer": ".sharded",
}

__all__ = [
    "CheckpointError",
    "Committed",
    "FileRecord",
    "FsspecCheckpointOptions",
    "FsspecCheckpointer",
    "InBackground",
    "LocalCheckpointOptions",
    "LocalCheckpointer",
    "Manifest",
    "ShardedCheckpointer",
    "Stager",
    "UnsafeCheckpointError",
    "checkpointer",
    "expired",
    "stage",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
