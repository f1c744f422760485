"""The ``ups`` command (``main``): one module per built-in command, registered as a plugin's
commands are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._common import EXIT_PREEMPTED
    from ._main import main

_EXPORTS = {
    "EXIT_PREEMPTED": "._common",
    "main": "._main",
}
"""Each public name and the module that defines it."""

__all__ = [
    "EXIT_PREEMPTED",
    "main",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
