"""A real single-node SLURM for tests: munged, slurmctld and slurmd in a private folder.

Needs root and Debian's ``slurm-wlm`` and ``munge`` packages (``apt-get install
slurm-wlm munge``). :func:`start` writes a minimal ``slurm.conf`` (the node is ``localhost``
with this machine's CPUs, one partition ``debug``), a fresh munge key, and starts the three
daemons in the foreground as children of the test process, on ports of their own, so it
neither needs nor touches a system SLURM. :meth:`Cluster.stop` ends them by pid.

:func:`unavailable` says why a cluster cannot be started here (``None`` when it can).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import attrs

from ups.core.testing import wait_for

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
_START_TIMEOUT_S = 30.0


def unavailable() -> str | None:
    """Why a test cluster cannot be started here, or ``None``."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} not found; "
            "apt-get install slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        return "the test SLURM cluster runs its daemons as root"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@attrs.define
class Cluster:
    folder: Path
    conf: Path
    procs: list[subprocess.Popen[bytes]] = attrs.field(factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What a SLURM client needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def daemon_log(self) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            path = self.folder / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """End the daemons (slurmd first), by pid: SIGTERM, then SIGKILL after 10 s."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()


def _conf(folder: Path, cpus: int) -> str:
    return "\n".join(
        [
            "ClusterName=upstest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long SLURM holds a requeued job (default 120 s; the same
            # node cannot start it while the killed run's credential is revoked).
            f"AuthInfo=socket={folder / 'munge.sock'},cred_expire=10",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=600",
            f"NodeName=localhost CPUs={cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        ]
    )


def start(folder: Path) -> Cluster:
    """Start munged, slurmctld and slurmd configured in ``folder``; return once ``sinfo``
    shows the node idle.

    :raises RuntimeError: a daemon that exits; AssertionError: a node not idle within 30 s
        (the daemons' logs attached); whatever was started is stopped first.
    """
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # munged refuses a world-writable socket folder
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, os.cpu_count() or 1) + "\n")
    cluster = Cluster(folder=folder, conf=conf)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    commands = {
        "munged": [
            "munged", "--foreground", "--force", f"--key-file={key}",
            f"--socket={folder / 'munge.sock'}", f"--pid-file={folder / 'munged.pid'}",
            f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}",
        ],
        "slurmctld": ["slurmctld", "-D", "-i", "-f", str(conf)],
        "slurmd": ["slurmd", "-D", "-f", str(conf)],
    }  # fmt: skip
    try:
        for name, argv in commands.items():
            argv[0] = str(_which(argv[0]))
            with open(folder / f"{name}.out", "wb") as out:
                cluster.procs.append(
                    subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
                    )
                )
            if name == "munged":
                _wait(cluster, lambda: (folder / "munge.sock").exists(), "munged's socket")
        _wait(cluster, lambda: _node_state(env) == "idle", "the node to be idle")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _node_state(env: dict[str, str]) -> str:
    result = subprocess.run(
        ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env, check=False
    )
    return result.stdout.strip()


def _wait(cluster: Cluster, condition: Callable[[], object], what: str) -> None:
    """Return once ``condition()`` is true; fail, with the daemons' logs, as soon as one of
    them exits, or after ``_START_TIMEOUT_S``."""

    def met() -> object:
        dead = [p.args for p in cluster.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"test SLURM: {dead} exited\n{cluster.daemon_log()}")
        return condition()

    wait_for(met, _START_TIMEOUT_S, f"test SLURM: {what}", details=cluster.daemon_log)
