"""The store of the ``fsspec`` backend, without torch: what its checkpointer
(:class:`~ups.ckpt.FsspecCheckpointer`) and its probe (run by ``ups validate``, which imports
no torch) share."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ups.core import ConfigError, check_writable

if TYPE_CHECKING:
    from ._remote import FsspecCheckpointOptions

URL_KEY = "checkpoint.options.url"
"""The config key that says where the ``fsspec`` backend keeps checkpoints."""


def store_url(url: str, directory: Path) -> str:
    """``checkpoint.options.url`` as the backend names it: without a trailing ``/``, and a
    relative path taken relative to the run's folder ``directory``."""
    url = url.rstrip("/")
    if "://" not in url and not Path(url).is_absolute():
        url = str(Path(directory) / url)
    return url


def filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path of ``url`` on it.

    :raises ConfigError: when fsspec, or the implementation the URL's protocol needs, is not
        installed.
    """
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]
        from fsspec.utils import get_protocol  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            "checkpoint.options.url",
            "the fsspec backend needs fsspec and s3fs: pip install 'ups-ckpt[fsspec]'",
        ) from None
    options = dict(storage_options)
    if get_protocol(url) in ("file", "local"):
        options.setdefault("auto_mkdir", True)  # a folder per checkpoint, made as files go in
    try:
        fs, root = url_to_fs(url, **options)
    except (ImportError, ValueError, TypeError) as error:  # "Install s3fs to access S3", ...
        raise ConfigError("checkpoint.options", f"{url}: {type(error).__name__}: {error}") from None
    return fs, str(root).rstrip("/")


def probe_store(*, directory: Path, options: FsspecCheckpointOptions) -> None:
    """The ``fsspec`` backend's :class:`~ups.core.CheckpointProbe`: on a local path,
    that its folder can be made and written (:func:`ups.core.check_writable`); in a store, that
    an empty probe object can be written under the URL and deleted again.

    :raises ConfigError: naming ``checkpoint.options.url``, the URL and the store's answer.
    """
    from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

    url = store_url(options.url, directory)
    fs, root = filesystem(url, options.storage_options)
    if isinstance(fs, LocalFileSystem):
        check_writable(Path(root), URL_KEY, "the checkpoints' folder")
        return
    name = f".ups-probe-{secrets.token_hex(4)}"
    try:
        fs.pipe_file(f"{root}/{name}", b"")
        fs.rm_file(f"{root}/{name}")
    except Exception as error:  # the store's own errors: no common base class
        raise ConfigError(
            URL_KEY,
            f"checkpoints cannot be written under {url}: writing and deleting the probe "
            f"object {url}/{name} failed: {type(error).__name__}: {error}; allowed: a URL "
            "where these credentials may write and delete",
        ) from None
