"""ups-ckpt: checkpoint backends for ups.

``local`` keeps each checkpoint as a folder of files written by every rank and committed
atomically (a ``COMMIT`` manifest with each file's size and CRC-32, a rename, a ``latest``
pointer); see :mod:`ups.ckpt.local`. Select it in the config with
``checkpoint: {name: local, options: {keep_last: 3}}``; ``async_save: true`` writes in the
background (:mod:`ups.ckpt.background`).

The commit protocol the backends share, its errors and records (:class:`CheckpointError`,
:class:`Manifest`, ...) are the engine's (:mod:`ups.core.checkpoint`), re-exported here.

In a loop of one's own, :func:`checkpointer` builds one from a folder or URL and options (see
docs/own-loop.md).
"""

from typing import TYPE_CHECKING

from ups.core import lazy_exports

if TYPE_CHECKING:
    from ups.core import (
        CheckpointError,
        Committed,
        FileRecord,
        Manifest,
        UnsafeCheckpointError,
        expired,
    )

    from ._by_path import checkpointer
    from .background import InBackground, Stager, stage
    from .local import LocalCheckpointer, LocalCheckpointOptions
    from .remote import FsspecCheckpointer, FsspecCheckpointOptions
    from .sharded import ShardedCheckpointer

_EXPORTS = {
    **dict.fromkeys(
        [
            "CheckpointError",
            "Committed",
            "FileRecord",
            "Manifest",
            "UnsafeCheckpointError",
            "expired",
        ],
        "ups.core",
    ),
    "checkpointer": "._by_path",
    "InBackground": ".background",
    "Stager": ".background",
    "stage": ".background",
    "LocalCheckpointer": ".local",
    "LocalCheckpointOptions": ".local",
    "FsspecCheckpointer": ".remote",
    "FsspecCheckpointOptions": ".remote",
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
