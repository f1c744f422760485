"""ups-ckpt: checkpoint backends for ups.

``local`` keeps each checkpoint as a folder of files written by every rank and committed
atomically (a ``COMMIT`` manifest with each file's size and CRC-32, a rename, a ``latest``
pointer); see :class:`~ups.ckpt.LocalCheckpointer`. Select it in the config with
``checkpoint: {name: local, options: {keep_last: 3}}``; ``async_save: true`` writes in the
background (:class:`~ups.ckpt.InBackground`).

The commit protocol the backends share, its errors and records (:class:`CheckpointError`,
:class:`Manifest`, ...) are the engine's (:mod:`ups.core.checkpoint`), re-exported here.

In a loop of one's own, :func:`checkpointer` builds one from a folder or URL and options (see
docs/own-loop.md).

Its names are imported when first used (PEP 562): ``import ups.ckpt`` imports no backend (and
no torch). The modules beneath it (``_name.py``) are private; :mod:`ups.ckpt.plugin` is the
entry point.
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

    from ._background import InBackground, Locating, Stager, stage
    from ._by_path import checkpointer
    from ._local import LocalCheckpointer, LocalCheckpointOptions
    from ._remote import FsspecCheckpointer, FsspecCheckpointOptions, FsspecStorage
    from ._sharded import ShardedCheckpointer

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
    "InBackground": "._background",
    "Locating": "._background",
    "Stager": "._background",
    "stage": "._background",
    "LocalCheckpointer": "._local",
    "LocalCheckpointOptions": "._local",
    "FsspecCheckpointer": "._remote",
    "FsspecCheckpointOptions": "._remote",
    "FsspecStorage": "._remote",
    "ShardedCheckpointer": "._sharded",
}

__all__ = [
    "CheckpointError",
    "Committed",
    "FileRecord",
    "FsspecCheckpointOptions",
    "FsspecCheckpointer",
    "FsspecStorage",
    "InBackground",
    "LocalCheckpointOptions",
    "LocalCheckpointer",
    "Locating",
    "Manifest",
    "ShardedCheckpointer",
    "Stager",
    "UnsafeCheckpointError",
    "checkpointer",
    "expired",
    "stage",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
