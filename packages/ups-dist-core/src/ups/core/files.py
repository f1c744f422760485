"""Durable file operations for checkpoints: what survives a crash once it has returned."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` so that readers see the old or the new whole:
    a temporary file in the same folder, fsynced, renamed over ``path``, the folder fsynced."""
    tmp = path.with_name(f".{path.name}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "x") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (files created, renamed or removed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
