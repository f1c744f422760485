"""What a training loop of one's own uses (docs/own-loop.md): who this process is in the job and
the process group's life cycle (``RunContext``, ``distributed_session``), collectives that decide
once and act everywhere (``decide``, ``all_mean``, ``Agreement``), a stop every rank agrees on
(``Preemption``), and the step watchdog (``Watchdog``). None of it imports the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._context import RunContext, distributed_session
    from ._collectives import Agreement, Failure, RankFailedError, RankUsageError, all_mean, decide, gather_failures
    from ._preemption import Preemption
    from ._watchdog import Watchdog

_EXPORTS = {
    "RunContext": "._context",
    "distributed_session": "._context",
    "Agreement": "._collectives",
    "Failure": "._collectives",
    "RankFailedError": "._collectives",
    "RankUsageError": "._collectives",
    "all_mean": "._collectives",
    "decide": "._collectives",
    "gather_failures": "._collectives",
    "Preemption": "._preemption",
    "Watchdog": "._watchdog",
}
"""Each public name and the module that defines it."""

__all__ = [
    "Agreement",
    "all_mean",
    "decide",
    "distributed_session",
    "Failure",
    "gather_failures",
    "Preemption",
    "RankFailedError",
    "RankUsageError",
    "RunContext",
    "Watchdog",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
