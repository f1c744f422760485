"""The run's folder, ``run.output_dir/run.name``: who owns it, and what rank 0 writes there
besides checkpoints.

- ``.lock``: held by rank 0 for the run's life (a POSIX lock, released by the kernel however
  the process ends); it holds the owner's pid and host. A second run on the folder is refused,
  naming that pid; readers (``ups report``) never take it;
- ``config.yaml``: the resolved configuration (overrides applied), so a run can be repeated
  and compared; its file paths (``model.factory``'s ``file.py``) relative to the folder, so
  that the folder moved or copied together with the project it names still loads
  (:func:`~ups.core.engine._weights.load_model`, ``ups export``);
- ``metrics.jsonl``: one JSON object a line for every training report and evaluation, with
  ``kind`` (``train`` or ``eval``) and ``step``: one history, each step once. A resumed run
  first drops the lines after the checkpoint it resumes from (:func:`keep_until`): they are
  the interrupted attempt's, which the resumed one reports again;
- ``preempted.json``: ``{"step": N}`` when a preemption signal stopped the run, every rank
  saved at step ``N``; removed when a run starts in the folder. ``ups train --nproc`` reads it
  to exit with its preempted status, since the ranks under its agent exit 0.

A fresh run (``checkpoint.resume: none``, not restarted by its launcher) never mixes with one
that used the folder before: rank 0 moves the earlier run's files to ``<folder>.<N>`` (the
first free N) before any rank writes there, and logs where (:func:`own_run_dir`). A launcher's
files about its job (:data:`JOB_FILES`) stay.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import math
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import structlog
import yaml

from ..checkpoint._files import write_atomically
from ..config._config import Config, relative_paths
from ..config._errors import UsageError
from ..dist._collectives import all_max, decide
from ..dist._context import RunContext

log = structlog.get_logger()

PREEMPTED = "preempted.json"
LOCK_FILE = ".lock"
"""In the run folder: locked by the process that owns the run; holds ``PID HOST``."""
JOB_FILES = (
    *("launch.json", "job.json", "launch.log", "exit.json", "cancelled", "launches"),
    *("slurm.sbatch", "slurm-*.out", "startup.log"),
)
"""What launchers (``ups launch``, ups-cloud's) keep in the run folder about the job that
runs the training (names, or ``fnmatch`` patterns: SLURM writes the job's output to
``slurm-<job id>.out``): written before its ranks start, so they stay when an earlier run's
files are moved aside, and they are no earlier run."""


class RunFiles:
    """Rank 0's writer of the run folder's files; on other ranks every method does nothing.
    ``config.yaml`` is written as it starts, unless ``stage``: a stage's writer, of a run whose
    ``config.yaml`` holds every stage."""

    def __init__(self, config: Config, ctx: RunContext, *, stage: bool = False) -> None:
        self.folder = config.run_dir
        self.enabled = ctx.is_main
        self._metrics_fd: int | None = None
        if self.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
        if self.enabled and not stage:
            saved = relative_paths(config, self.folder)
            text = yaml.safe_dump(_plain(attrs.asdict(saved)), sort_keys=False)
            write_atomically(self.folder / "config.yaml", text)
            (self.folder / PREEMPTED).unlink(missing_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.folder / "metrics.jsonl"

    def metrics(
        self,
        kind: Literal["train", "eval", "best", "phases"],
        step: int,
        values: Mapping[str, Any],
    ) -> None:
        """Append one line of metrics (``best``: a new best checkpoint, saved at ``step``,
        and keep-best's monitored value; ``phases``: each rank's time per phase of a step,
        :mod:`~ups.core.observe._phases`; NaN written as ``null``), in one write (a kill leaves
        whole lines, but for the last), without Python's buffered file on top (a report's
        cost is the engine's, every ``run.log_every`` steps). The file is opened at the first
        line, after a resume has cut it (:func:`keep_until`), and stays open until
        :meth:`close`."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": step} | {
            k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()
        }
        if self._metrics_fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            self._metrics_fd = os.open(self.metrics_path, flags, 0o644)
        os.write(self._metrics_fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        """Close ``metrics.jsonl`` (a later line opens it again)."""
        if self._metrics_fd is not None:
            os.close(self._metrics_fd)
            self._metrics_fd = None

    def preempted(self, step: int) -> None:
        """Record that a preemption signal stopped the run, saved at ``step``."""
        if self.enabled:
            (self.folder / PREEMPTED).write_text(json.dumps({"step": step}) + "\n")


def keep_until(folder: Path, step: int) -> int:
    """Drop the lines of ``folder/metrics.jsonl`` after ``step`` (and a line cut short by a
    kill), for a run resuming from its checkpoint of ``step``: every report up to it was
    written before that checkpoint was saved, every later one is reported again. The file is
    replaced atomically (a crash leaves it whole, before or after). Returns the lines dropped.

    The file is in step order, so only its end is read: the lines after ``step``.
    """
    path = folder / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = len(lines)
    while kept and not _reported_by(lines[kept - 1], step):
        kept -= 1
    if kept < len(lines):
        write_atomically(path, "".join(lines[:kept]))
    return len(lines) - kept


def _reported_by(line: str, step: int) -> bool:
    """Whether ``line`` is a whole record of a step up to ``step``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    reported = record.get("step") if isinstance(record, dict) else None
    return line.endswith("\n") and isinstance(reported, int) and reported <= step


class RunLock:
    """The lock on a run folder that its owning process holds for the run's life: a POSIX
    lock (``lockf``) on ``FOLDER/.lock``, released when :meth:`release` closes it or the
    process ends, however it ends. Unlike ``flock``, forked children (loader workers) do not
    hold it, so it is free as soon as the owner is gone. Never open the lock file in the
    owning process otherwise: closing any descriptor of it releases a POSIX lock."""

    def __init__(self, folder: Path) -> None:
        """Lock ``folder`` (made if missing) and write this process's pid and host into it.

        :raises UsageError: naming the folder and the pid of the process holding it.
        """
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / LOCK_FILE
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(self._fd)
            self._fd = None
            if error.errno in (errno.EACCES, errno.EAGAIN):
                raise _in_use(folder) from None
            log.warning("the run folder's filesystem refuses locks: not locked", error=str(error))
            return
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()} {socket.gethostname()}\n".encode())

    def release(self) -> None:
        """Unlock the folder (the lock file stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_free(folder: Path) -> None:
    """Refuse a run folder that a live run holds, without taking it: for a launcher, before it
    starts any rank. Not to be called in the process that holds the lock (see :class:`RunLock`).

    :raises UsageError: naming the folder and the pid of the process holding it.
    """
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EAGAIN):
            raise _in_use(folder) from None
    finally:
        os.close(fd)


def _in_use(folder: Path) -> UsageError:
    """The refusal of a folder another run holds, naming its owner as the lock file says."""
    try:
        owner = (folder / LOCK_FILE).read_text().split()
    except OSError:
        owner = []
    pid, host = [*owner, "?", "?"][:2]
    return UsageError(
        f"run folder {folder} is in use by the run of process {pid} on {host}: wait for it to "
        "end or stop it, or choose another run.name (-o run.name=...)"
    )


@contextlib.contextmanager
def own_run_dir(config: Config, ctx: RunContext) -> Iterator[None]:
    """Own the run folder while the block runs, before any rank writes there: rank 0 locks it
    (:class:`RunLock`) and, for a fresh run, moves an earlier run's files aside (see the module
    doc); every rank waits for that and gets its outcome. A run that resumes
    (``checkpoint.resume: latest``) or that its launcher restarted keeps the folder. A
    collective: every rank enters it.

    :raises UsageError: on every rank, when another run holds the folder.
    """
    fresh = config.checkpoint.resume == "none" and not all_max(ctx, ctx.restart_count)
    held: list[RunLock] = []

    def claim() -> str | None:
        try:
            held.append(_claim(config.run_dir, fresh=fresh))
        except UsageError as error:
            return str(error)
        return None

    refused = decide(ctx, claim)
    if refused is not None:
        raise UsageError(refused)
    try:
        yield
    finally:
        for lock in held:
            lock.release()


def _claim(folder: Path, *, fresh: bool) -> RunLock:
    """Lock ``folder``; for a fresh run, first move an earlier run's files aside."""
    lock = RunLock(folder)
    if not fresh or not any(_is_run_file(entry) for entry in folder.iterdir()):
        return lock
    aside = _move_aside(folder)
    try:
        new = RunLock(folder)  # another run may have made the folder meanwhile: then it is its
        for entry in aside.iterdir():
            if _is_job_file(entry.name):
                os.rename(entry, folder / entry.name)
    finally:
        lock.release()
        (aside / LOCK_FILE).unlink(missing_ok=True)
    log.info(f"{folder} held an earlier run: moved it to {aside}", moved_to=str(aside))
    return new


def _is_run_file(entry: Path) -> bool:
    return not _is_job_file(entry.name) and entry.name != LOCK_FILE


def _is_job_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in JOB_FILES)


def _move_aside(folder: Path) -> Path:
    """Rename ``folder`` to ``<folder>.<N>``, the first N free; return the new path."""
    number = 1
    while True:
        aside = folder.with_name(f"{folder.name}.{number}")
        if not aside.exists():
            try:
                os.rename(folder, aside)  # fails on a folder made meanwhile that is not empty
            except OSError as error:
                if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            else:
                return aside
        number += 1


def _plain(value: object) -> object:
    """attrs.asdict output with tuples as lists, so it dumps as plain YAML."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
