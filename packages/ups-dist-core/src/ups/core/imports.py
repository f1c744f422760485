"""Load user code named in the config: ``package.module:callable`` or ``path/to/file.py:callable``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError


def resolve_spec(spec: str, base_dir: Path) -> str:
    """Make a file path in ``spec`` absolute, relative to ``base_dir`` (the config's folder)."""
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py") and not Path(target).is_absolute():
        return f"{(base_dir / target).resolve()}:{attr}"
    return spec


def load_object(spec: str, key: str) -> Callable[..., Any]:
    """Import and return the callable ``spec`` names.

    :param key: the config key path holding ``spec``, for the error message.
    :raises ConfigError: when the form is wrong, or the module, file or attribute is missing.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise ConfigError(
            key, f"{spec!r} is not an import path: use package.module:callable or file.py:callable"
        )
    if target.endswith(".py"):
        module = _load_file(Path(target), key)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as error:
            raise ConfigError(key, f"cannot import {target!r}: {error}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(key, f"{target!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def _load_file(path: Path, key: str) -> Any:
    if not path.is_file():
        raise ConfigError(key, f"no such file: {path}")
    # One module per file, under a stable name, so pickling (spawned workers) finds it again.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"ups_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
