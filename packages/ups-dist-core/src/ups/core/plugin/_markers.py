"""The pluggy project name and the typed markers every ups plugin uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pluggy

NAME = "ups"
"""The pluggy project name, and the entry-point group plugins register under."""

_F = TypeVar("_F", bound=Callable[..., Any])

hookspec: Callable[[_F], _F] = pluggy.HookspecMarker(NAME)
"""Marks a function in :mod:`ups.core.plugin.hookspecs` as a hook specification."""

hookimpl: Callable[[_F], _F] = pluggy.HookimplMarker(NAME)
"""Marks a plugin's function as the implementation of the ``ups_*`` hook of the same name."""

hookimpl_default = pluggy.HookimplMarker(NAME)(trylast=True)
"""The marker of built-in implementations: they run last, so any plugin can override them."""
