"""File operations of the run's folder and of checkpoints: writes that survive a crash once
they have returned, and a probe of whether a folder can be written at all."""

from __future__ import annotations

import errno
import os
import secrets
import tempfile
from pathlib import Path

from ..config._errors import ConfigError


def write_atomically(path: Path, text: str | bytes) -> None:
    """Replace ``path``'s content with ``text`` (or bytes) so that readers see the old or the new whole:
    a temporary file in the same folder, fsynced, renamed over ``path``, the folder fsynced.

    A failure (a full disk) leaves ``path`` as it was, no temporary file beside it, and raises
    the :class:`OSError` naming ``path`` where the system's error names no file.
    """
    tmp = path.with_name(f".{path.name}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb" if isinstance(text, bytes) else "x") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None:  # a write's: no file named
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (files created, renamed or removed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_writable(folder: Path) -> Path:
    """Check that files can be made in ``folder``, or, while it does not exist, in its nearest
    existing ancestor, where making it would start: create an empty file there and remove it.
    No folder is made and nothing is left behind. Returns the folder probed.

    :raises NotADirectoryError: naming the file in the way, when ``folder`` or an ancestor is
        a file.
    :raises OSError: what creating the file raised (a read-only filesystem, no permission).
    """
    existing = next(path for path in (folder, *folder.parents) if path.exists())  # "." or "/"
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder", str(existing))
    try:
        fd, probe = tempfile.mkstemp(prefix=".ups-probe-", dir=existing)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(existing)) from None
    os.close(fd)
    os.unlink(probe)
    return existing


def check_writable(folder: Path, key: str, what: str) -> None:
    """Check that ``what`` (``"the run's folder"``) ``folder``, set by the config key ``key``,
    can be made and written, by :func:`probe_writable`: nothing is left behind.

    :raises ConfigError: naming ``key``, ``folder``, and the file in the way or why the folder
        it would be made in cannot be written.
    """
    try:
        probe_writable(folder)
    except NotADirectoryError as error:
        raise ConfigError(
            key, f"{what} {folder} cannot be made: {error.filename} is a file, not a folder"
        ) from None
    except OSError as error:
        at = "" if Path(error.filename) == folder else f" (at {error.filename})"
        raise ConfigError(
            key,
            f"{what} {folder} cannot be written: {error.strerror}{at}; allowed: a folder "
            "this user can create files in",
        ) from None
