"""The ``local`` launcher: ``torch.distributed.run`` on this machine, detached, followed by file.

``submit`` starts::

    PYTHON -m torch.distributed.run --standalone --nproc-per-node N -m ups.core train CONFIG -o ...

in a session of its own, through a small runner (:mod:`ups.cloud._runner`) that records the exit
status. With ``nnodes`` > 1 it rehearses a multi-machine job on this one: a bash script starts
one torchrun agent per "node", all joined by a c10d rendezvous on ``127.0.0.1`` (the first
agent serves it), waits for every agent, and exits with the status of the last one that failed
(0 if none did); the dry run prints that script. Everything about the job lives in its run folder, ``<run_dir>/<run.name>/`` (the
training run's own folder when ``run.output_dir`` is ``run_dir``, as by default)::

    job.json      the job record: pid, command, working directory, start time, log path
    launch.log    the job's stdout and stderr
    exit.json     the exit status, written when the job ends
    cancelled     written by ``cancel``

so ``status``, ``logs`` and ``cancel`` work from any later process, given the folder (the
handle ``submit`` returns) or the run's name (looked up under ``./runs``). ``ups launch`` writes
its own, launcher-independent record, ``launch.json``, next to them (see
:mod:`ups.core.launch_record`). A folder's earlier launches, those files and ``launch.json``, are
moved to ``launches/<start time>/`` when it is submitted again.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs
import structlog

from ups.core import (
    AGENT_ENV,
    Config,
    JobState,
    LaunchRequest,
    UsageError,
    above,
    agent_args,
    free_port,
    load_config,
    train_args,
    write_atomically,
)

from . import _procs
from ._runner import EXIT_FILE, LOG_FILE

log = structlog.get_logger()


RECORD_FILE = "job.json"
"""The job record (:class:`JobRecord`); ``launch.json`` is the ``ups`` command's record."""
CLI_RECORD_FILE = "launch.json"
CANCEL_FILE = "cancelled"
HISTORY = "launches"
DEFAULT_RUN_DIR = LaunchRequest(config=Path()).run_dir
"""Where a handle that is a bare run name is looked up (relative to the working directory)."""
_START_TIMEOUT_S = 60.0
_REAP_TIMEOUT_S = 10.0


@attrs.frozen(kw_only=True)
class LocalLauncherOptions:
    """Options of the ``local`` launcher."""

    python: str = attrs.field(factory=lambda: sys.executable)
    """The Python that runs the job; it must have ups and the config's plugins installed.
    Default: the Python running ups."""
    cancel_grace_s: float = attrs.field(default=10.0, validator=above(0))
    """Seconds ``cancel`` waits after SIGTERM before it sends SIGKILL."""
    rdzv_port: int | None = attrs.field(default=None, validator=attrs.validators.optional(above(0)))
    """The rendezvous port of a job of several local nodes; default: a free port."""


@attrs.frozen(kw_only=True)
class JobRecord:
    """The content of ``job.json``: how to find and follow a job that was started."""

    name: str
    pid: int
    """The runner's pid: the leader of the job's session and process group."""
    proc_start: int | None
    """The runner's start time in clock ticks (Linux), so a reused pid is not taken for it."""
    command: tuple[str, ...]
    cwd: str
    start_time: str
    """ISO 8601, UTC."""
    log: str
    """The path of ``launch.log``."""
    format: int = 1

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)

    @property
    def proc(self) -> _procs.Proc:
        return _procs.Proc(self.pid, self.proc_start)

    def to_json(self) -> str:
        data = attrs.asdict(self)
        data["command_line"] = self.command_line
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> JobRecord:
        """Read ``job.json``; a damaged one is a :class:`UsageError` naming it."""
        try:
            data = json.loads(path.read_text())
            return cls(
                name=str(data["name"]),
                pid=int(data["pid"]),
                proc_start=None if data.get("proc_start") is None else int(data["proc_start"]),
                command=tuple(str(part) for part in data["command"]),
                cwd=str(data["cwd"]),
                start_time=str(data["start_time"]),
                log=str(data["log"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise UsageError(f"{path}: not a readable job record ({error})") from None


class LocalLauncher:
    """Runs configs with ``torch.distributed.run`` on this machine (see the module doc)."""

    def __init__(self, *, options: LocalLauncherOptions) -> None:
        self.options = options

    # -- the Launcher protocol ----------------------------------------------------------------

    def dry_run(self, request: LaunchRequest) -> str:
        """The command line :meth:`submit` would run, shell-quoted; for several nodes, the
        script that starts them."""
        command = self.command(request)
        return command[2] if request.nnodes > 1 else shlex.join(command)

    def submit(self, request: LaunchRequest) -> str:
        """Start ``request`` detached; return its run folder (the handle of the job).

        :raises UsageError: a bad request or config, or a job of that run still running.
        """
        config = load_config(request.config, request.overrides)
        command = self._command(request, config)
        folder = (request.run_dir / config.run.name).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self._archive_previous(folder)
        log_path = folder / LOG_FILE
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **AGENT_ENV}
        runner = [sys.executable, "-m", "ups.cloud._runner", str(folder), os.getcwd(), "--"]
        start_time = _now()
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                [*runner, *command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=env,
            )
            try:
                out, _ = proc.communicate(timeout=_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise RuntimeError(
                    f"the job did not start within {_START_TIMEOUT_S}s; see {log_path}"
                ) from None
        if proc.returncode != 0 or not out.strip().isdigit():
            raise RuntimeError(f"the job could not be started; see {log_path}")
        pid = int(out)
        record = JobRecord(
            name=config.run.name,
            pid=pid,
            proc_start=_procs.identify(pid).start,
            command=tuple(command),
            cwd=os.getcwd(),
            start_time=start_time,
            log=str(log_path),
        )
        write_atomically(folder / RECORD_FILE, record.to_json())
        log.info("job submitted", run=record.name, pid=pid, folder=str(folder))
        return str(folder)

    def status(self, handle: str) -> JobState:
        """``RUNNING`` while the job's runner lives; then ``SUCCEEDED`` (exit status 0),
        ``CANCELLED`` (after :meth:`cancel`) or ``FAILED``."""
        folder, record = self._find(handle)
        return _state(folder, record)

    def logs(self, handle: str) -> str:
        """The job's output so far (stdout and stderr of every rank and of the agent)."""
        _, record = self._find(handle)
        try:
            return Path(record.log).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def cancel(self, handle: str) -> None:
        """Stop the job: SIGTERM to its process group (and to its workers, which torch runs in
        sessions of their own), then SIGKILL to whatever is left after ``cancel_grace_s``.
        Returns once every process of the job is gone. A job that has ended is left as it is."""
        folder, record = self._find(handle)
        if _state(folder, record) != JobState.RUNNING:
            return
        write_atomically(folder / CANCEL_FILE, _now() + "\n")
        leader = record.proc
        # Take the family down while its lineage is known: orphans are re-parented to init.
        family = {leader, *_procs.descendants(leader)}
        _signal_all(record.pid, family, signal.SIGTERM)
        deadline = time.monotonic() + self.options.cancel_grace_s
        while time.monotonic() < deadline:
            family |= set(_procs.descendants(leader))
            if not any(_procs.alive(p) for p in family):
                break
            time.sleep(0.1)
        else:
            family |= set(_procs.descendants(leader))
            log.warning(
                "job still running after SIGTERM; sending SIGKILL",
                folder=str(folder),
                grace_s=self.options.cancel_grace_s,
            )
            _signal_all(record.pid, family, signal.SIGKILL)
            deadline = time.monotonic() + _REAP_TIMEOUT_S
            while any(_procs.alive(p) for p in family) and time.monotonic() < deadline:
                time.sleep(0.05)
        left = sorted(p.pid for p in family if _procs.alive(p))
        if left:
            raise RuntimeError(f"processes {left} of the job in {folder} survived SIGKILL")
        log.info("job cancelled", folder=str(folder))

    # -- helpers ------------------------------------------------------------------------------

    def command(self, request: LaunchRequest) -> list[str]:
        """The argv of the job :meth:`submit` starts for ``request``: torchrun, or for several
        nodes ``bash -c SCRIPT`` (see the module doc); with ``--max-restarts`` when the config
        sets ``distributed.max_restarts``.

        :raises UsageError: a bad number of nodes or processes, a bad config, or a system
            without process groups.
        """
        return self._command(request, load_config(request.config, request.overrides))

    def _command(self, request: LaunchRequest, config: Config) -> list[str]:
        if request.nnodes < 1 or request.nproc_per_node < 1:
            raise UsageError(
                f"nnodes and nproc_per_node must be >= 1, not {request.nnodes} and "
                f"{request.nproc_per_node}"
            )
        if os.name != "posix":
            raise UsageError("the local launcher needs a POSIX system (sessions, process groups)")
        train = train_args(Path(request.config).resolve(), request.overrides)
        torchrun = [self.options.python, "-m", "torch.distributed.run"]
        torchrun += agent_args(config.distributed.max_restarts)
        nproc = ["--nproc-per-node", str(request.nproc_per_node)]
        if request.nnodes == 1:
            return [*torchrun, "--standalone", *nproc, *train]
        port = self.options.rdzv_port or free_port()
        lines = [
            f"# {request.nnodes} local nodes of {request.nproc_per_node} processes, "
            f"rendezvous on 127.0.0.1:{port}",
            "pids=()",
        ]
        for node in range(request.nnodes):
            agent = [
                *torchrun, "--nnodes", str(request.nnodes), *nproc,
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", f"ups-local-{port}",
                "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                *train,
            ]  # fmt: skip
            lines += [f"{shlex.join(agent)} &", "pids+=($!)"]
        lines += [
            "status=0",
            'for pid in "${pids[@]}"; do wait "$pid" || status=$?; done',
            'exit "$status"',
        ]
        return ["bash", "-c", "\n".join(lines) + "\n"]

    def _find(self, handle: str) -> tuple[Path, JobRecord]:
        path = Path(handle)
        candidates = [path] if path.is_absolute() else [path, DEFAULT_RUN_DIR / path]
        for folder in candidates:
            if (folder / RECORD_FILE).is_file():
                return folder.resolve(), JobRecord.read(folder / RECORD_FILE)
        looked = " or ".join(str(c / RECORD_FILE) for c in candidates)
        raise UsageError(
            f"no job {handle!r}: no job record at {looked}; pass the folder submit returned"
        )

    def _archive_previous(self, folder: Path) -> None:
        if not (folder / RECORD_FILE).exists():
            return
        previous = JobRecord.read(folder / RECORD_FILE)
        if _state(folder, previous) == JobState.RUNNING:
            raise UsageError(
                f"run {previous.name!r} is still running in {folder} (pid {previous.pid}); "
                "cancel it, or choose another run.name (-o run.name=...)"
            )
        stamp = previous.start_time.replace(":", "").replace("-", "").replace("+0000", "Z")
        archive = folder / HISTORY / f"{stamp}-{previous.pid}"
        archive.mkdir(parents=True, exist_ok=True)
        for name in (RECORD_FILE, CLI_RECORD_FILE, LOG_FILE, EXIT_FILE, CANCEL_FILE):
            if (folder / name).exists():
                os.replace(folder / name, archive / name)


def _state(folder: Path, record: JobRecord) -> JobState:
    ended = _exit_code(folder)
    if ended is None:
        if _procs.alive(record.proc):
            return JobState.RUNNING
        ended = _exit_code(folder)  # it may have just ended
    if ended == 0:
        return JobState.SUCCEEDED
    return JobState.CANCELLED if (folder / CANCEL_FILE).exists() else JobState.FAILED


def _exit_code(folder: Path) -> int | None:
    try:
        data: Any = json.loads((folder / EXIT_FILE).read_text())
        return int(data["returncode"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return -1  # a damaged record of an ended job


def _signal_all(pgid: int, family: set[_procs.Proc], sig: signal.Signals) -> None:
    _procs.signal_group(pgid, sig)
    for proc in family:
        _procs.signal_proc(proc, sig)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
