"""What the launchers need to know about local processes: alive or not, and their descendants.

A process is named by its pid and, on Linux, its start time (``/proc/<pid>/stat``), so a pid
the kernel reused for another process is not mistaken for the job. Elsewhere only the pid is
known, and descendants cannot be listed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import attrs

_PROC = Path("/proc")


@attrs.frozen
class Proc:
    """A process: its pid and, where the system tells, its start time (clock ticks since boot)."""

    pid: int
    start: int | None = None


@attrs.frozen
class _Stat:
    state: str
    ppid: int
    start: int


def _stat(pid: int) -> _Stat | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    fields = text[text.rindex(")") + 2 :].split()
    return _Stat(state=fields[0], ppid=int(fields[1]), start=int(fields[19]))


def identify(pid: int) -> Proc:
    """``pid`` with its start time, when the system tells it."""
    stat = _stat(pid)
    return Proc(pid, stat.start if stat is not None else None)


def alive(proc: Proc) -> bool:
    """Whether ``proc`` still runs: it exists, is not a zombie, and is the same process."""
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, but is not ours
    stat = _stat(proc.pid)
    if stat is None:
        return not _PROC.is_dir()  # no /proc: the signal is all we know
    if stat.state in ("Z", "X"):
        return False
    return proc.start is None or stat.start == proc.start


def descendants(root: Proc) -> list[Proc]:
    """Every living descendant of ``root`` (Linux only; elsewhere an empty list)."""
    if not _PROC.is_dir() or not alive(root):
        return []
    children: dict[int, list[Proc]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat.state not in ("Z", "X"):
                children.setdefault(stat.ppid, []).append(Proc(int(entry.name), stat.start))
    found: list[Proc] = []
    todo = [root.pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pgid``, if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_proc(proc: Proc, sig: signal.Signals) -> None:
    """Send ``sig`` to ``proc``, if it is still that process."""
    if alive(proc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)
