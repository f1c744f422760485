"""Starting ranks, for launcher authors and the Python API: ``train`` runs a config on local
processes (``run_processes`` any function), and what a launcher puts on a machine's command line
(``train_args``, ``agent_args``, ``agent_exports``, ``AGENT_ENV``, ``free_port``);
``rank_failures`` reads which ranks failed, and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._processes import (
        AGENT_ENV,
        agent_args,
        agent_exports,
        free_port,
        rank_failures,
        run_processes,
        train,
        train_args,
    )

_EXPORTS = {
    "AGENT_ENV": "._processes",
    "agent_args": "._processes",
    "agent_exports": "._processes",
    "free_port": "._processes",
    "rank_failures": "._processes",
    "run_processes": "._processes",
    "train": "._processes",
    "train_args": "._processes",
}
"""Each public name and the module that defines it."""

__all__ = [
    "agent_args",
    "AGENT_ENV",
    "agent_exports",
    "free_port",
    "rank_failures",
    "run_processes",
    "train",
    "train_args",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
