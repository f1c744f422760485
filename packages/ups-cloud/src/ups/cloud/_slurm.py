"""The ``slurm`` launcher: an sbatch script that runs ``torch.distributed.run`` through ``srun``.

``submit`` writes ``<run_dir>/<run.name>/slurm.sbatch`` and runs
``sbatch --parsable --output=<run folder>/slurm-%j.out ... slurm.sbatch``. The script asks for
``nnodes`` nodes with one task each (``--ntasks-per-node=1``: one torchrun agent per node),
and runs::

    srun PYTHON -m torch.distributed.run --nnodes $SLURM_NNODES --nproc-per-node N \\
        --rdzv-backend c10d --rdzv-endpoint $head_node:PORT --rdzv-id $SLURM_JOB_ID \\
        -m ups.core train CONFIG -o ...

with the rendezvous on the allocation's first node (``scontrol show hostnames`` of
``$SLURM_JOB_NODELIST``) and, unless ``rdzv_port`` is set, a port derived from the job id so
that two jobs sharing a node do not collide.

Pre-emption: ``signal_seconds`` adds ``#SBATCH --signal=B:USR1@SECONDS``. SLURM then signals
the batch shell only (``B:``), which traps the signal and passes SIGUSR1 on to every process of
the job's steps (``scancel --signal=USR1``). torchrun's agents run with SIGUSR1 ignored (srun
starts them through ``bash -c 'trap "" USR1; exec "$@"'``), so only the ranks act on it: they
save a checkpoint at their next step boundary and stop (``checkpoint.preempt_signals``, which
includes SIGUSR1 by default), the agents see them end and exit 0. Each rank gets the signal
exactly once: SIGTERM would not do, as the agent passes SIGTERM on too and a rank's second
signal acts as it would without ups (it kills the rank mid-save). A rank that has not yet
installed its handler ignores the notice. Without ``requeue`` the script then exits 75, as
``ups train`` does when preempted (resumable, not failed), so SLURM reports the job failed
with that exit code and its log says how to resume. With
``requeue``, the script requeues the job (``scontrol requeue``); it is submitted with
``--requeue --open-mode=append`` and ``-o checkpoint.resume=latest`` (before the request's
overrides, which may change it), so the requeued job continues from that checkpoint (SLURM
starts a requeued job after a delay of its own).

The handle is ``JOBID:RUN_FOLDER``; a bare job id works too (its output file is then asked of
``scontrol show job``). ``status`` asks ``squeue``, then ``scontrol show job``, then ``sacct``;
``logs`` reads the job's output file; ``cancel`` runs ``scancel`` and waits for the job to end.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import attrs
import structlog

from ups.core import (
    EXIT_PREEMPTED,
    JobState,
    LaunchRequest,
    UsageError,
    above,
    agent_args,
    agent_exports,
    at_least,
    load_config,
    train_args,
    write_atomically,
)

log = structlog.get_logger()

SCRIPT_FILE = "slurm.sbatch"
OUTPUT_PATTERN = "slurm-%j.out"
"""The job's stdout and stderr, in its run folder (``%j``: the job id)."""

_PENDING = {
    "PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
}  # fmt: skip
_RUNNING = {
    "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING",
}  # fmt: skip
_CANCELLED = {"CANCELLED", "REVOKED"}
_LIVE = (JobState.PENDING, JobState.RUNNING)
# Anything else that has ended (FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, ...) is
# FAILED.

# The validators say what is allowed, not the value: the message names the key and the value
# (``launch.options.time: '4 hours' is not allowed: must be ...``, see ups.core.structure).
_WORD = re.compile(r"^[^\s'\"\\]+$")
_TIME = re.compile(
    r"\d+(:\d+){0,2}"  # MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS
    r"|\d+-\d+(:\d+){0,2}"  # DAYS-HOURS, DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS
    r"|(?i:infinite|unlimited)"
)
TIME_FORMATS = (
    "MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or "
    "DAYS-HOURS:MINUTES:SECONDS (e.g. '4:00:00' for 4 hours, '2-00:00:00' for 2 days; "
    "quoted in YAML), or UNLIMITED"
)
"""The forms of ``--time`` sbatch accepts, as the message for another one lists them."""


def _word(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and not _WORD.match(value):
        raise ValueError("must be one word, without spaces or quotes")


def _time(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and not _TIME.fullmatch(value):
        raise ValueError(f"must be a SLURM time: {TIME_FORMATS}")


def _line(instance: object, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
    for item in value if isinstance(value, tuple) else ():
        if "\n" in item or "\r" in item or not item.strip():
            raise ValueError(f"each item must be one non-empty line (one directive), not {item!r}")


def _port(instance: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and not 1 <= value <= 65535:
        raise ValueError("must be a port, 1..65535")


@attrs.frozen(kw_only=True)
class SlurmOptions:
    """Options of the ``slurm`` launcher (``launch.options``)."""

    partition: str | None = attrs.field(default=None, validator=_word)
    """``--partition``; default: the cluster's default partition."""
    account: str | None = attrs.field(default=None, validator=_word)
    """``--account`` charged for the job."""
    time: str | None = attrs.field(default=None, validator=_time)
    """``--time`` limit, in one of sbatch's forms (:data:`TIME_FORMATS`), e.g. ``"4:00:00"``
    or ``"2-00:00:00"``; default: the partition's."""
    gpus_per_node: int = attrs.field(default=0, validator=at_least(0))
    """``--gpus-per-node``; 0 (the default): a CPU job (gloo), no GPUs asked for."""
    cpus_per_task: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(at_least(1))
    )
    """``--cpus-per-task`` (the task is a node's torchrun agent and all its ranks)."""
    mem: str | None = attrs.field(default=None, validator=_word)
    """``--mem`` per node, e.g. ``"64G"``."""
    signal_seconds: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(at_least(1))
    )
    """Pre-emption notice: ``--signal=B:USR1@SECONDS``, passed on to the ranks (not to torchrun's
    agents), which save and stop (see the module doc)."""
    requeue: bool = False
    """``--requeue``; after a pre-emption notice the script requeues the job, which resumes
    from the latest checkpoint."""
    python: str = attrs.field(factory=lambda: sys.executable)
    """The Python on the compute nodes that has ups and the config's plugins installed.
    Default: the Python running ups (a shared file system is assumed)."""
    rdzv_port: int | None = attrs.field(default=None, validator=_port)
    """The c10d rendezvous port on the first node; default: 20000 + job id % 20000."""
    job_name: str | None = attrs.field(default=None, validator=_word)
    """``--job-name``; default: ``ups-<run.name>``."""
    extra: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_line)
    """More ``#SBATCH`` directives, written as given after the others, e.g.
    ``["--qos=high", "--constraint=a100"]``."""
    sbatch: str = "sbatch"
    srun: str = "srun"
    squeue: str = "squeue"
    scontrol: str = "scontrol"
    sacct: str = "sacct"
    scancel: str = "scancel"
    cancel_timeout_s: float = attrs.field(default=60.0, validator=above(0))
    """Seconds ``cancel`` waits for the job to end after ``scancel``."""


class SlurmLauncher:
    """Runs configs as SLURM batch jobs (see the module doc)."""

    def __init__(self, *, options: SlurmOptions) -> None:
        self.options = options

    # -- the Launcher protocol ----------------------------------------------------------------

    def dry_run(self, request: LaunchRequest) -> str:
        """The sbatch command :meth:`submit` would run, then the script it would submit."""
        folder, script = self._prepare(request)
        command = shlex.join(self.sbatch_command(folder))
        return f"# {command}\n# {folder / SCRIPT_FILE}:\n{script}"

    def submit(self, request: LaunchRequest) -> str:
        """Write the script into the run folder and submit it; return ``JOBID:RUN_FOLDER``.

        :raises UsageError: a bad request or config, or a job SLURM refuses (naming the option).
        """
        folder, script = self._prepare(request)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / SCRIPT_FILE, script)
        result = self._run(self.sbatch_command(folder), what="submit the job")
        if result.returncode != 0:
            raise UsageError(self._explain(result.stderr))
        job_id = result.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"
        if not job_id.isdigit():
            raise RuntimeError(f"sbatch answered {result.stdout.strip()!r}, not a job id")
        log.info("job submitted", job_id=job_id, folder=str(folder))
        return f"{job_id}:{folder}"

    def status(self, handle: str) -> JobState:
        """The job's state, from ``squeue``, else ``scontrol show job``, else ``sacct``."""
        job_id, _ = _parse(handle)
        state = self._slurm_state(job_id)
        if state in _PENDING:
            return JobState.PENDING
        if state in _RUNNING:
            return JobState.RUNNING
        if state == "COMPLETED":
            return JobState.SUCCEEDED
        return JobState.CANCELLED if state.split()[0] in _CANCELLED else JobState.FAILED

    def logs(self, handle: str) -> str:
        """The job's output file so far (its stdout and stderr); empty before it starts."""
        job_id, folder = _parse(handle)
        if folder is not None:
            path = folder / OUTPUT_PATTERN.replace("%j", job_id)
        else:
            fields = self._show_job(job_id)
            if fields is None or "StdOut" not in fields:
                raise UsageError(
                    f"job {job_id} is no longer known to SLURM; pass the handle submit "
                    "returned (JOBID:RUN_FOLDER)"
                )
            path = Path(fields["StdOut"])
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def cancel(self, handle: str) -> None:
        """``scancel`` the job and wait until SLURM reports it ended (at most
        ``cancel_timeout_s``). A job that has ended is left as it is."""
        job_id, _ = _parse(handle)
        if self.status(handle) not in _LIVE:
            return
        result = self._run([self.options.scancel, job_id], what="cancel the job")
        if result.returncode != 0:
            raise UsageError(f"scancel {job_id} failed: {_last_line(result.stderr)}")
        deadline = time.monotonic() + self.options.cancel_timeout_s
        while self.status(handle) in _LIVE:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"job {job_id} still not ended {self.options.cancel_timeout_s}s after scancel"
                )
            time.sleep(0.2)
        log.info("job cancelled", job_id=job_id)

    # -- helpers ------------------------------------------------------------------------------

    def sbatch_command(self, folder: Path) -> list[str]:
        """The argv that submits ``folder/slurm.sbatch`` (output paths are given here, on the
        command line, so that no path needs quoting inside ``#SBATCH`` lines)."""
        return [
            self.options.sbatch, "--parsable",
            f"--output={folder / OUTPUT_PATTERN}", f"--error={folder / OUTPUT_PATTERN}",
            str(folder / SCRIPT_FILE),
        ]  # fmt: skip

    def script(self, request: LaunchRequest, name: str, max_restarts: int = 0) -> str:
        """The batch script for ``request`` (``name``: the run's name; ``max_restarts``: how
        often torchrun restarts the ranks after a failure, the config's
        ``distributed.max_restarts``)."""
        if request.nnodes < 1:
            raise UsageError(f"nnodes must be >= 1, not {request.nnodes}")
        if request.nproc_per_node < 1:
            raise UsageError(f"nproc_per_node must be >= 1, not {request.nproc_per_node}")
        o = self.options
        directives = [
            f"--job-name={o.job_name or 'ups-' + re.sub(r'[^A-Za-z0-9_.-]', '_', name)}",
            f"--nodes={request.nnodes}",
            "--ntasks-per-node=1",
        ]
        optional = {
            "partition": o.partition,
            "account": o.account,
            "time": o.time,
            "gpus-per-node": o.gpus_per_node,
            "cpus-per-task": o.cpus_per_task,
            "mem": o.mem,
            "signal": o.signal_seconds and f"B:USR1@{o.signal_seconds}",
        }
        directives += [f"--{flag}={value}" for flag, value in optional.items() if value]
        directives += ["--requeue", "--open-mode=append"] if o.requeue else ["--no-requeue"]
        directives += o.extra
        overrides = (
            ("checkpoint.resume=latest", *request.overrides) if o.requeue else request.overrides
        )
        port = str(o.rdzv_port) if o.rdzv_port else "$((20000 + SLURM_JOB_ID % 20000))"
        srun = [o.srun, "--kill-on-bad-exit=1"]
        if o.cpus_per_task:
            srun.append(f"--cpus-per-task={o.cpus_per_task}")
        # The agent ignores SIGUSR1 (the ranks, which inherit that, install handlers of their own).
        srun += ["bash", "-c", 'trap "" USR1; exec "$@"', "ups-agent"]
        torchrun = [
            o.python, "-m", "torch.distributed.run",
            *agent_args(max_restarts),
            "--nproc-per-node", str(request.nproc_per_node),
            "--rdzv-backend", "c10d",
            *train_args(Path(request.config).resolve(), overrides),
        ]  # fmt: skip
        # Quoted words, with the values only known on the allocation spliced in after
        # "torch.distributed.run".
        head = shlex.join([*srun, *torchrun[:3]])
        tail = shlex.join(torchrun[3:])
        lines = [
            "#!/bin/bash",
            f"# ups: run {name!r} on {request.nnodes} node(s) x {request.nproc_per_node} "
            "process(es); written by the slurm launcher",
            *(f"#SBATCH {d}" for d in directives),
            "set -u",
            "export PYTHONUNBUFFERED=1",
            *agent_exports(),
            f'head_node=$({shlex.quote(o.scontrol)} show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"port={port}",
            'echo "ups: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous at $head_node:$port"',
            "preempted=",
            "on_notice() {",
            '    echo "ups: pre-emption notice (SIGUSR1): the ranks save and stop" >&2',
            "    preempted=1",
            f'    {shlex.quote(o.scancel)} --signal=USR1 "$SLURM_JOB_ID"',
            "}",
            "trap on_notice USR1",
            f'{head} --nnodes "$SLURM_NNODES" --rdzv-endpoint "$head_node:$port" '
            f'--rdzv-id "$SLURM_JOB_ID" {tail} &',
            "pid=$!",
            "# wait returns early when a trapped signal arrives: wait until srun has ended, then",
            "# once more for its exit status (bash keeps it)",
            'wait "$pid"',
            'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done',
            'wait "$pid"',
            "status=$?",
        ]
        if o.requeue:
            lines += [
                'if [ -n "$preempted" ]; then',
                '    echo "ups: requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint" >&2',
                f'    {shlex.quote(o.scontrol)} requeue "$SLURM_JOB_ID"',
                "fi",
            ]
        else:
            lines += [
                'if [ -n "$preempted" ] && [ "$status" = 0 ]; then',
                '    echo "ups: stopped by the pre-emption notice; the ranks saved where they'
                ' stopped; resume with -o checkpoint.resume=latest" >&2',
                f"    status={EXIT_PREEMPTED}",
                "fi",
            ]
        lines.append('exit "$status"')
        return "\n".join(lines) + "\n"

    def _prepare(self, request: LaunchRequest) -> tuple[Path, str]:
        config = load_config(request.config, request.overrides)
        folder = (request.run_dir / config.run.name).resolve()
        return folder, self.script(request, config.run.name, config.distributed.max_restarts)

    def _run(self, argv: list[str], *, what: str) -> subprocess.CompletedProcess[str]:
        if shutil.which(argv[0]) is None:
            raise UsageError(
                f"cannot {what}: {argv[0]!r} not found (is this a SLURM login node? "
                "the slurm launcher's options name its commands, e.g. sbatch)"
            )
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{shlex.join(argv)} did not answer within 60s") from None

    def _explain(self, stderr: str) -> str:
        """One line for an sbatch refusal, naming the option it is most likely about."""
        message = _last_line(stderr)
        text = stderr.lower()
        option = next(
            (
                name
                for name, words in (
                    ("partition", ("partition",)),
                    ("account", ("account", "association")),
                    ("time", ("time limit", "time_limit", "invalid time")),
                    ("mem", ("memory",)),
                    ("gpus_per_node", ("gres", "gpu")),
                    ("cpus_per_task", ("cpus-per-task", "cpus per task")),
                    ("extra", ("unrecognized option", "invalid option")),
                )
                if any(word in text for word in words)
            ),
            None,
        )
        if option is None:
            return f"sbatch refused the job: {message}"
        value = getattr(self.options, option)
        return f"sbatch refused the job (launch.options.{option}={value!r}): {message}"

    def _slurm_state(self, job_id: str) -> str:
        result = self._run(
            [self.options.squeue, "-h", "-j", job_id, "--states=all", "-o", "%T"],
            what="ask for the job's state",
        )
        state = result.stdout.strip().splitlines()
        if result.returncode == 0 and state:
            return state[0].strip()
        fields = self._show_job(job_id)
        if fields is not None and "JobState" in fields:
            return fields["JobState"]
        if shutil.which(self.options.sacct) is not None:
            result = self._run(
                [self.options.sacct, "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                what="ask for the job's state",
            )
            states = result.stdout.strip().splitlines()
            if result.returncode == 0 and states and states[0].strip().isupper():
                return states[0].strip()
        raise UsageError(f"job {job_id} is not known to SLURM (squeue, scontrol, sacct)")

    def _show_job(self, job_id: str) -> dict[str, str] | None:
        result = self._run(
            [self.options.scontrol, "show", "job", "--oneliner", job_id],
            what="ask for the job",
        )
        if result.returncode != 0:
            return None
        return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)


def _parse(handle: str) -> tuple[str, Path | None]:
    job_id, _, folder = handle.partition(":")
    if not job_id.isdigit():
        raise UsageError(f"no job {handle!r}: a slurm handle is JOBID or JOBID:RUN_FOLDER")
    return job_id, Path(folder) if folder else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"
