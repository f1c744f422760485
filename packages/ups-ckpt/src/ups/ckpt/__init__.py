"""ups-ckpt: checkpoint backends for ups.

``local`` keeps each checkpoint as a folder of files written by every rank and committed
atomically (a ``COMMIT`` manifest, a rename, a ``latest`` pointer); see :mod:`ups.ckpt.local`.
Select it in the config with ``checkpoint: {name: local, options: {keep_last: 3}}``.
"""

from .local import (
    RNG_KEY,
    CheckpointError,
    Committed,
    LocalCheckpointer,
    LocalCheckpointOptions,
    Manifest,
    UnsafeCheckpointError,
    expired,
    restore_rng,
)

__all__ = [
    "RNG_KEY",
    "CheckpointError",
    "Committed",
    "LocalCheckpointOptions",
    "LocalCheckpointer",
    "Manifest",
    "UnsafeCheckpointError",
    "expired",
    "restore_rng",
]
