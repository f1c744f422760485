"""Durable file operations for checkpoints: what survives a crash once it has returned."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (files created, renamed or removed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
