"""The run context: who this process is in the job, and the process group's life cycle.

A :class:`RunContext` is built from the environment a launcher leaves behind (torchrun's
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``..., or SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``/... when
started by ``srun``), or describes a plain single process. :func:`distributed_session` turns a
context into an initialised process group and tears it down again.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Literal

import attrs
import structlog
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from ..config._arguments import check_type, choice, number
from ..config._errors import UsageError

log = structlog.get_logger()

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""Set (to ``True``) by torchrun's agent where the ranks' store is its own, kept across restarts."""

Backend = Literal["auto", "gloo", "nccl"]
Enabled = bool | Literal["auto"]
LauncherKind = Literal["torchrun", "slurm", "single"]
"""What started this process (not a :class:`ups.core.Launcher`, which starts a whole job): torchrun's
agent, SLURM's ``srun``, or nothing (one process)."""


@attrs.frozen(kw_only=True)
class RunContext:
    """Where this process stands in the job. Every rank holds one; all fields but rank differ only
    where they must."""

    rank: int = 0
    """Global rank, 0 to ``world_size - 1``."""
    local_rank: int = 0
    """Rank on this machine; picks the device."""
    world_size: int = 1
    """Number of processes in the job."""
    local_world_size: int = 1
    """Number of processes on this machine."""
    node_rank: int = 0
    """Index of this machine in the job."""
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable
    """The device this rank computes on."""
    timeout_s: float = 300.0
    """The time any collective may take before it fails (``distributed.timeout_s``); a process
    group a plugin makes of its own should use it too."""
    backend: str | None = None
    """The process group's backend (``gloo``/``nccl``), or ``None`` when not distributed."""
    launcher: LauncherKind = "single"
    """What started this process: ``torchrun``, ``slurm`` (``srun``) or ``single``."""
    restart_count: int = 0
    """How many times the launcher restarted this job (torchrun's
    ``TORCHELASTIC_RESTART_COUNT``, SLURM's ``SLURM_RESTART_COUNT`` for a requeued job)."""

    @property
    def distributed(self) -> bool:
        """Whether a process group is in use (a world of more than one, or one asked for)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that logs, writes shared files and decides."""
        return self.rank == 0


@attrs.frozen(kw_only=True)
class Placement:
    """The ranks a launcher assigned, read from the environment, plus the rendezvous address."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    launcher: LauncherKind
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UsageError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _count(env: Mapping[str, str], key: str) -> int:
    return _int(env, key) if env.get(key) else 0


def collective_timeout(timeout_s: float) -> float:
    """The process group's own timeout for ``distributed.timeout_s``: a grace of
    ``min(timeout_s, 60)`` seconds later, in which the step watchdog names the silent ranks
    (:mod:`ups.core.dist._watchdog`) before a collective fails without naming them."""
    return timeout_s + min(timeout_s, 60.0)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,7],gpu1`` gives ``node03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise UsageError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def read_placement(env: Mapping[str, str]) -> Placement:
    """Read this process's placement from a launcher's environment variables.

    torchrun's variables win over SLURM's (``srun torchrun ...`` is a torchrun job); with
    neither, the process is a single process of a world of one.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return Placement(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=_int(env, "WORLD_SIZE"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1,
            node_rank=_int(env, "GROUP_RANK") if "GROUP_RANK" in env else 0,
            launcher="torchrun",
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            restart_count=_count(env, "TORCHELASTIC_RESTART_COUNT"),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        job_id = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        ntasks = _int(env, "SLURM_NTASKS")
        nnodes = _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else 1
        return Placement(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=ntasks,
            local_world_size=max(1, ntasks // max(1, nnodes)),
            node_rank=_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0,
            launcher="slurm",
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            # The same port on every rank of a job, different for jobs sharing a node.
            master_port=_int(env, "MASTER_PORT")
            if "MASTER_PORT" in env
            else 15000 + job_id % 20000,
            restart_count=_count(env, "SLURM_RESTART_COUNT"),
        )
    return Placement(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, launcher="single"
    )


def launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher (torchrun, srun) started this process as a rank of a job."""
    return read_placement(os.environ if env is None else env).launcher != "single"


def choose_backend(requested: Backend, local_rank: int) -> str:
    """``auto`` is nccl when this rank has a CUDA device of its own, else gloo."""
    if requested != "auto":
        return requested
    cuda = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    return "nccl" if cuda else "gloo"


def _device_for(backend: str | None, local_rank: int) -> torch.device:
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@contextlib.contextmanager
def distributed_session(
    enabled: Enabled = "auto",
    backend: Backend = "auto",
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[RunContext]:
    """Initialise the process group this process's environment describes; yield its context.

    ``enabled``: ``"auto"`` uses a process group when the world has more than one process and
    falls back to a single process, with a warning, when initialisation fails (unless the
    launcher restarted the job); ``True`` always uses one and fails with a :class:`UsageError`
    when it cannot; ``False`` never does (and refuses to run as one of several ranks).
    ``backend``: ``"auto"`` (nccl where this rank has a GPU, else gloo), ``"gloo"`` or
    ``"nccl"``. ``timeout_s`` (> 0) bounds every collective (with the grace of
    :func:`collective_timeout`). ``env``: the environment to read (``None``: this process's).
    The process group is destroyed on exit, whatever happened inside.

    Restarted by torchrun, the ranks meet again under a store prefix of their attempt's own
    (``TORCHELASTIC_RESTART_COUNT``) where torchrun's agent keeps the store across restarts, as
    with ``--master-port`` (see :func:`_init`).

    :raises ConfigError: naming the argument that is of the wrong type (an
        :class:`~ups.core.config._arguments.ArgumentTypeError`, a ``TypeError`` too) or value (an
        :class:`~ups.core.config._arguments.ArgumentValueError`, a ``ValueError`` too).
    """
    choice("enabled", enabled, (True, False, "auto"))
    choice("backend", backend, typing.get_args(Backend))
    timeout_s = number("timeout_s", timeout_s, above=0)
    if env is not None:
        check_type("env", env, Mapping, "a mapping of environment variables, or None")
    env = os.environ if env is None else env
    place = read_placement(env)
    if enabled is False:
        if place.world_size > 1:
            raise UsageError(
                f"distributed.enabled is false but this process is rank {place.rank} of "
                f"{place.world_size}; set it to auto or true, or launch one process"
            )
        yield _single(place)
        return
    if enabled == "auto" and place.world_size == 1:
        yield _single(place)
        return
    chosen = choose_backend(backend, place.local_rank)
    try:
        _init(place, chosen, timeout_s)
    except Exception as error:
        if enabled is True or place.restart_count:  # a restarted rank must rejoin its peers
            why = "is true" if enabled is True else "is auto and the job was restarted"
            raise UsageError(
                f"distributed.enabled {why} but rank {place.rank} of {place.world_size} could "
                f"not join the process group ({chosen}): {error}"
            ) from error
        log.warning(
            "distributed init failed; running as a single process",
            rank=place.rank,
            backend=chosen,
            error=str(error),
        )
        yield _single(place)
        return
    ctx = RunContext(
        rank=place.rank,
        local_rank=place.local_rank,
        world_size=place.world_size,
        local_world_size=place.local_world_size,
        node_rank=place.node_rank,
        device=_device_for(chosen, place.local_rank),
        backend=chosen,
        launcher=place.launcher,
        timeout_s=timeout_s,
        restart_count=place.restart_count,
    )
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    elif "OMP_NUM_THREADS" not in env:
        # Ranks on one machine share its cores; oversubscribed threads slow every rank down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // place.local_world_size))
    try:
        yield ctx
        # Leave together: a rank that tears down while another still talks to it aborts both.
        dist.barrier()
    finally:
        # Free what still holds the group (a DDP reducer in a reference cycle) while Python is
        # alive: freed during interpreter shutdown, gloo's threads abort the process.
        gc.collect()
        dist.destroy_process_group()


def _single(place: Placement) -> RunContext:
    return RunContext(
        device=_device_for(None, 0), launcher=place.launcher, restart_count=place.restart_count
    )


def _init(place: Placement, backend: str, timeout_s: float) -> None:
    """Join the process group at ``MASTER_ADDR:MASTER_PORT``; where torchrun's agent hosts
    that store, under a prefix of this attempt's own (``ups/attempt-<restart count>``).

    The agent's store (``TORCHELASTIC_USE_AGENT_STORE``: with ``--master-port``, a static
    rendezvous, or c10d's without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) lives across
    restarts: without the prefix, a restarted attempt's ranks would read the addresses the
    failed attempt's left there and fail to connect to them (``Gloo connectFullMesh failed ...
    Connection refused``), or wait for ever. Any other store is rank 0's, new each attempt, and
    takes no prefix: a machine that joins afresh counts its restarts from 0 while the others
    count on, so the count would keep it apart from them (as torch's own ``env://`` does, the
    prefix keys on the agent's count only where the agent keeps the store).
    """
    if place.master_addr is None or place.master_port is None:
        raise UsageError(
            f"rank {place.rank}: MASTER_ADDR and MASTER_PORT are needed to join a process group"
        )
    timeout = datetime.timedelta(seconds=collective_timeout(timeout_s))
    url = f"tcp://{place.master_addr}:{place.master_port}"
    store, _, _ = next(rendezvous(url, place.rank, place.world_size, timeout=timeout))
    if os.environ.get(AGENT_STORE) == str(True):
        store = PrefixStore(f"ups/attempt-{place.restart_count}", store)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=place.rank,
        world_size=place.world_size,
        timeout=timeout,
    )
