"""Processes that end with the process that started them: ranks with their launcher, loader
workers with their rank.

A launcher killed with SIGKILL (the OOM killer, a scheduler, ``kill -9``) or by a closed
terminal runs no code on its way out, so it cannot stop its ranks; a rank that ends the same way
cannot stop its loader workers. So each process holds a lifeline to its starter and ends itself
(SIGKILL) when the starter is gone:

- a process whose parent is its starter (the ranks of ``ups train --nproc N``, run by the elastic
  agent in the launcher; a rank's loader workers) asks the kernel for SIGKILL when its parent
  ends: Linux's parent-death signal (:func:`die_with_parent`). The kernel sends it when the
  parent *thread* that started the process ends, so the starter must start it from a thread
  that lives as long as the process is of use (the agent's; the thread that iterates the
  loader). Elsewhere than Linux nothing is set;
- a rank that :mod:`multiprocessing` started (:func:`~ups.core.run_processes`,
  ``ups.core.train(nproc=N)``) is a fork of ups's forkserver, which outlives the launcher while
  any rank lives (every rank holds the forkserver's liveness pipe). It watches the launcher
  itself: the pipe :mod:`multiprocessing` gives every child, whose other end only the launcher
  holds, reads end-of-file once the launcher is gone (:func:`watch_starter`, on one thread of
  its own, started before the rank forks any worker and alive as long as it).

The chain ``ups train`` -> rank -> worker thus unwinds from any link, and a rank's end takes
its workers with it however it ends (the step watchdog's exit included).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

LAUNCHER = "UPS_LAUNCHER_PID"
"""The environment variable by which a launcher that runs its ranks as new programs (``ups
train --nproc N``) names itself to them; each rank removes it from its environment, so its own
children never read it."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """End this process (SIGKILL) when the thread of ``parent`` that started it ends, or now
    if ``parent`` is not this process's parent any more (it ended before this call, and this
    process was handed to a reaper); on Linux, elsewhere nothing.

    :raises OSError: when the kernel refuses the parent-death signal.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_loader(worker_id: int) -> None:
    """A ``DataLoader`` ``worker_init_fn``: the worker ends with the process that started it,
    its rank (torch has set the worker up before; it calls this first, before the user's
    dataset code). Call it first in a ``worker_init_fn`` of one's own.

    ``worker_id`` is unused: every worker of a loader does the same.
    """
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid)


def watch_starter() -> None:
    """Tie this rank to the process that started it, which this process then never outlives:
    the launcher named by :data:`LAUNCHER` (then removed from the environment), watched by the
    parent-death signal; or the :mod:`multiprocessing` parent, watched on a thread until its
    end of the pipe closes. Nothing for a process started otherwise (by a shell, or a launcher
    of another project)."""
    launcher = os.environ.pop(LAUNCHER, None)
    parent = multiprocessing.parent_process()
    if launcher is not None:
        die_with_parent(int(launcher))
    elif parent is not None:
        threading.Thread(
            target=_die_on_close, args=(parent.sentinel,), name="ups-lifeline", daemon=True
        ).start()


def _die_on_close(sentinel: int) -> None:
    """Wait until the starter's end of the pipe ``sentinel`` closes (it ended), then end."""
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGKILL)
