"""ups-ckpt: checkpoint backends for ups.

``local`` keeps each checkpoint as a folder of files written by every rank and committed
atomically (a ``COMMIT`` manifest with each file's size and CRC-32, a rename, a ``latest``
pointer); see :mod:`ups.ckpt.local`. Select it in the config with
``checkpoint: {name: local, options: {keep_last: 3}}``; ``async_save: true`` writes in the
background (:mod:`ups.ckpt.background`).

In a loop of one's own, :func:`checkpointer` builds one from a folder or URL and options (see
docs/own-loop.md).
"""

from typing import TYPE_CHECKING, Any

from ._by_path import checkpointer
from .background import InBackground, Stager, stage
from .errors import CheckpointError, UnsafeCheckpointError
from .local import Committed, LocalCheckpointer, LocalCheckpointOptions
from .manifest import Manifest
from .remote import FsspecCheckpointer, FsspecCheckpointOptions
from .retention import expired
from .serialize import FileRecord

if TYPE_CHECKING:
    from .sharded import ShardedCheckpointer

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


def __getattr__(name: str) -> Any:
    """``ShardedCheckpointer`` on first use: its module imports torch.distributed.checkpoint,
    half a second that a run not using ``sharded`` should not pay on every rank."""
    if name == "ShardedCheckpointer":
        from .sharded import ShardedCheckpointer

        return ShardedCheckpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
