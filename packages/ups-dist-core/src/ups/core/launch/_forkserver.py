"""Ranks started from a process that has imported torch once, not each from nothing.

A rank started with ``spawn`` imports torch, and DDP's first use imports ``torch._dynamo``: about
2 s of CPU each, for every rank of every launch and restart (4 ranks on 2 cores: seconds of wall
time before the first step). :func:`start_method` gives :func:`~ups.core.run_processes` a
forkserver (where the platform has one) that imports :data:`PRELOAD` once; each rank is then a
fork of it, ready in milliseconds. The forkserver is one per Python process and lives as long as
it, so every later launch, restart or trial from the same process reuses it.

A fork starts with the forkserver's environment, frozen when it started; a spawned process has
its launcher's environment of the moment. :func:`restore_environment` gives a forked rank the
launcher's environment at launch, with what the elastic agent set for the rank on top: the two
start methods are alike to the code they run. A forkserver this process started before ups's
(one that did not preload this module) is not used: ranks are spawned then, as they are with
``UPS_START_METHOD=spawn``.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Mapping
from multiprocessing import forkserver

from ..config._errors import UsageError

CHOICE = "UPS_START_METHOD"
"""The environment variable that chooses: ``forkserver`` (the default) or ``spawn``, every rank a
fresh interpreter, as torch's launchers start them."""
PRELOAD = ["ups.core.launch._forkserver", "torch", "torch.distributed", "torch._dynamo"]
"""What the forkserver imports before it forks a rank: torch, and what DDP imports on
construction. Not the engine: a rank that runs a loop of its own never imports it."""

_IMPORTED_BY = os.getpid()
_ENVIRONMENT = dict(os.environ)
"""Where this module was imported, with the environment of then: in a rank forked from a
forkserver that preloaded it, the forkserver and its environment."""


def start_method() -> str:
    """``"forkserver"`` where this process's forkserver preloads :data:`PRELOAD` (it is set to
    when none has started yet), else ``"spawn"``; ``"spawn"`` too where :data:`CHOICE` says so.

    :raises UsageError: naming :data:`CHOICE` when it holds neither choice.
    """
    choice = os.environ.get(CHOICE, "forkserver")
    if choice not in ("forkserver", "spawn"):
        raise UsageError(f"{CHOICE}={choice!r}: allowed: forkserver, spawn")
    if choice == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    server = forkserver._forkserver  # the process's one server
    if getattr(server, "_forkserver_pid", 0) is None:  # none started yet
        forkserver.set_forkserver_preload(PRELOAD)
    return "forkserver" if getattr(server, "_preload_modules", None) == PRELOAD else "spawn"


def restore_environment(launcher: Mapping[str, str]) -> None:
    """Make ``os.environ`` the launcher's environment ``launcher``, with what started this
    process set on top (the elastic agent's variables for the rank). In a rank forked from ups's
    forkserver that replaces the forkserver's environment; in a spawned one it changes nothing
    the launcher has not changed since."""
    forked = os.getpid() != _IMPORTED_BY
    start = _ENVIRONMENT if forked else launcher
    starter = {k: v for k, v in os.environ.items() if start.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher)
    os.environ.update(starter)
