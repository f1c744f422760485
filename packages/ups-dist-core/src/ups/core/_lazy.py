"""Imports deferred until a name is used, so that the commands that do not train (``ups
--help``, ``plugins``, ``status``) import no torch and answer at once.

- :func:`lazy_exports`: a package's public names imported when first read (PEP 562). In a
  package's ``__init__.py``::

      __getattr__, __dir__ = lazy_exports(__name__, {"Name": ".module", ...})
      __all__ = ["Name", ...]

  with the same names imported under ``if TYPE_CHECKING:`` for type checkers.
- :func:`imported`: a registration record's ``factory`` or ``options`` named by
  ``"module:name"``, imported when the record is selected (:meth:`ups.core.Registry.get`) or
  the factory called, not when ``ups plugins`` lists it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

T = TypeVar("T")


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name of ``exports`` (name ->
    module, relative to ``package``) is imported from its module when first read, then kept."""

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return getattr_, dir_


@attrs.frozen
class Imported:
    """``name`` of the module ``module``, imported when used; calling it calls that object."""

    module: str
    name: str

    def load(self) -> Any:
        """The object, imported (once: Python keeps the module)."""
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)


def imported(spec: str) -> Any:
    """``"package.module:name"`` as a record's ``factory`` or ``options``, imported when used.

    Typed ``Any`` so that it stands for any factory protocol or options class.
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{spec!r} is not 'package.module:name'")
    return Imported(module, name)


def resolved(value: T) -> T:
    """``value``, or what it names if it is :func:`imported`."""
    return value.load() if isinstance(value, Imported) else value
