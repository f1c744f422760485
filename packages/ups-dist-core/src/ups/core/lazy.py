"""Names of a package imported when first used (PEP 562), for ``__init__`` modules whose
public names live in modules that import torch: ``import ups.core`` and a plugin's package then
cost no torch, so that the commands that do not train answer at once (``ups --help``,
``plugins``, ``status``).

In a package's ``__init__.py``::

    __getattr__, __dir__ = lazy_exports(__name__, {"Name": ".module", ...})
    __all__ = ["Name", ...]

with the same names imported under ``if TYPE_CHECKING:`` for type checkers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


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
