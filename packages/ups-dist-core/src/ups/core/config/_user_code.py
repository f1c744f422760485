"""Load user code named in the config: ``package.module:callable`` or ``path/to/file.py:callable``.

A file's folder goes on ``sys.path`` before the file is imported, as Python does for a script
it runs, so that the file imports the files beside it (``import helpers``) wherever ``ups``
runs from. A module or file that fails to import (a syntax error, an import of a package not
installed, any exception) is a :class:`~ups.core.config._errors.ConfigError` naming the config key, the
file and line, and the error; its traceback is the error's ``__cause__``, which ``ups`` prints
under :data:`TRACEBACK_ENV` (a rank's log file holds it anyway).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._errors import ConfigError

TRACEBACK_ENV = "UPS_TRACEBACK"
"""Set (to anything but empty), ``ups`` prints the traceback of a module or file named in the
config that failed to import, under its one-line error."""

_NOT_USERS = tuple(
    {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {str(Path(__file__).parent)}
)
"""The folders of Python's own modules, installed packages and ups: not the user's code, whose
line an import error names."""


def resolve_spec(spec: str, base_dir: Path) -> str:
    """Make a file path in ``spec`` absolute, relative to ``base_dir`` (the config's folder)."""
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py") and not Path(target).is_absolute():
        return f"{(base_dir / target).resolve()}:{attr}"
    return spec


def load_object(spec: str, key: str) -> Callable[..., Any]:
    """Import and return the callable ``spec`` names.

    :param key: the config key path holding ``spec``, for the error message.
    :raises ConfigError: when the form is wrong, the module, file or attribute is missing, or
        the module or file fails to import (chained to its error).
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise ConfigError(
            key, f"{spec!r} is not an import path: use package.module:callable or file.py:callable"
        )
    module = _load_file(Path(target), key) if target.endswith(".py") else _import(target, key)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(key, f"{target!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def _import(target: str, key: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as error:
        if error.name is not None and (target + ".").startswith(error.name + "."):
            raise ConfigError(key, f"cannot import {target!r}: {error}") from None
        raise import_failed(key, repr(target), error) from error  # an import inside it
    except (Exception, SystemExit) as error:
        raise import_failed(key, repr(target), error) from error


def _load_file(path: Path, key: str) -> Any:
    if not path.is_file():
        raise ConfigError(key, f"no such file: {path}")
    path = path.resolve()
    # One module per file, under a stable name, so pickling (spawned workers) finds it again.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"ups_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        del sys.modules[name]
        raise import_failed(key, str(path), error) from error
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_failed(key: str, what: str, error: BaseException) -> ConfigError:
    """The one-line error for ``what`` (a file or module named at ``key``) failing to import
    with ``error``: the user's line it failed at (the innermost outside Python's own modules,
    installed packages and ups, else the innermost), and the error.

    :param what: the file's path, or the module's name as the config gives it (quoted).
    """
    if isinstance(error, SyntaxError):  # raised where the file is compiled: its place is its own
        file, line = error.filename, error.lineno
        message = f"{type(error).__name__}: {error.msg}"
    else:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if _readable(f.filename)]
        ours = [f for f in frames if not f.filename.startswith(_NOT_USERS)] or frames[-1:]
        file, line = (ours[-1].filename, ours[-1].lineno) if ours else (None, None)
        message = type(error).__name__ + (f": {error}" if str(error) else "")
    if isinstance(error, ModuleNotFoundError):
        message += f" (is it installed for {sys.executable}?)"
    elif isinstance(error, SystemExit):
        message += (
            " (the file exits when imported: put its script under if __name__ == '__main__':)"
        )
    at = "" if file is None else " at " + ("" if file == what else f"{file}, ") + f"line {line}"
    return ConfigError(key, f"importing {what} failed{at}: {message}")


def _readable(filename: str) -> bool:
    """Whether a traceback's ``filename`` is a file (not ``<frozen importlib._bootstrap>``)."""
    return not filename.startswith("<")
