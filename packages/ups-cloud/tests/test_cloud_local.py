"""The ``local`` launcher: its command line, and jobs it really starts, follows and cancels."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from launched import Tidy, cancelling, tiny

import ups.cloud
from ups.cloud import LocalLauncher, LocalLauncherOptions
from ups.core import ConfigError, LauncherPlugin, LaunchRequest, UsageError, load_plugins
from ups.core.testing import events, wait_for


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The tiny problem, 1 epoch of 4 steps on 2 ranks."""
    return tiny(tmp_path)


class TidyLocal(Tidy, LocalLauncher):
    """A local launcher that remembers its jobs."""


@pytest.fixture
def launcher() -> Iterator[LocalLauncher]:
    """A launcher with a short grace period; every job it started is cancelled at teardown."""
    with cancelling(TidyLocal(options=LocalLauncherOptions(cancel_grace_s=2))) as launcher:
        yield launcher


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def ignores_sigterm(pid: int) -> bool:
    """Whether ``pid`` ignores SIGTERM (the ``SigIgn`` mask of its ``/proc`` status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def group_members(pgid: int) -> list[int]:
    """The living (not zombie) processes of the process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split() if stat else []
        if fields and int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(entry.name))
    return members


def test_code_under_test_is_this_tree() -> None:
    src = Path(__file__).resolve().parents[1] / "src"
    assert Path(ups.cloud.__file__).resolve().is_relative_to(src)


def test_the_local_launcher_is_registered_by_the_entry_point() -> None:
    registry = load_plugins(env={})
    provided = registry.records("launcher")["local"]
    assert provided.plugin == "ups-cloud"
    assert isinstance(provided.record, LauncherPlugin)
    assert registry.get("launcher", "local", "launch.name").factory is LocalLauncher
    _, options = registry.select("launcher", "local", {"cancel_grace_s": 3}, "launch")
    assert options == LocalLauncherOptions(python=sys.executable, cancel_grace_s=3.0)
    with pytest.raises(
        ConfigError, match=r"launch\.options\.cancel_grace_s: 0(\.0)? is not allowed"
    ):
        registry.select("launcher", "local", {"cancel_grace_s": 0}, "launch")


def test_dry_run_is_the_exact_command_line(project: Path) -> None:
    launcher = LocalLauncher(options=LocalLauncherOptions(python="/opt/py/bin/python3"))
    config = project / "my run.yaml"
    (project / "run.yaml").rename(config)
    request = LaunchRequest(
        config=config, nproc_per_node=4, overrides=("training.lr=3e-4", "run.name=a b")
    )
    assert launcher.dry_run(request) == (
        "/opt/py/bin/python3 -m torch.distributed.run --standalone --nproc-per-node 4 "
        f"-m ups.core train '{config.resolve()}' -o training.lr=3e-4 -o 'run.name=a b'"
    )
    assert shlex.split(launcher.dry_run(request)) == launcher.command(request)
    # The config's restarts go to the agent.
    restarts = attrs.evolve(request, overrides=("distributed.max_restarts=2",))
    assert launcher.command(restarts)[3:6] == ["--max-restarts", "2", "--standalone"]


def test_several_nodes_are_agents_joined_by_a_rendezvous_on_loopback(project: Path) -> None:
    options = LocalLauncherOptions(python="/opt/py/bin/python3", rdzv_port=29555)
    launcher = LocalLauncher(options=options)
    request = LaunchRequest(config=project / "run.yaml", nnodes=3, nproc_per_node=2)
    script = launcher.dry_run(request)
    assert launcher.command(request) == ["bash", "-c", script]
    agents = [line for line in script.splitlines() if line.endswith(" &")]
    assert len(agents) == 3
    for node, agent in enumerate(agents):
        argv = shlex.split(agent[:-2])
        assert argv[:3] == ["/opt/py/bin/python3", "-m", "torch.distributed.run"]
        assert "--standalone" not in argv
        for flag, value in [
            ("--nnodes", "3"),
            ("--nproc-per-node", "2"),
            ("--rdzv-backend", "c10d"),
            ("--rdzv-endpoint", "127.0.0.1:29555"),
            ("--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}"),
        ]:
            assert argv[argv.index(flag) + 1] == value
        assert argv[-3:] == ["ups.core", "train", str(project / "run.yaml")]
    assert 'exit "$status"' in script
    # Without a port, a free one: a new one each time.
    free = LocalLauncher(options=LocalLauncherOptions()).dry_run(request)
    assert "--rdzv-endpoint 127.0.0.1:" in free and "127.0.0.1:29555" not in free


@pytest.mark.parametrize(("nnodes", "nproc"), [(0, 1), (1, 0)])
def test_no_nodes_or_processes_is_refused(project: Path, nnodes: int, nproc: int) -> None:
    launcher = LocalLauncher(options=LocalLauncherOptions())
    request = LaunchRequest(config=project / "run.yaml", nnodes=nnodes, nproc_per_node=nproc)
    with pytest.raises(UsageError, match="nnodes and nproc_per_node must be >= 1"):
        launcher.dry_run(request)
    with pytest.raises(UsageError, match="must be >= 1"):
        launcher.submit(request)


def test_a_missing_config_or_job_is_a_usage_error(tmp_path: Path) -> None:
    launcher = LocalLauncher(options=LocalLauncherOptions())
    with pytest.raises(UsageError, match="cannot read config file"):
        launcher.submit(LaunchRequest(config=tmp_path / "nope.yaml", run_dir=tmp_path))
    with pytest.raises(UsageError, match="no job 'nope'"):
        launcher.status("nope")
    with pytest.raises(UsageError, match="no job record"):
        launcher.cancel(str(tmp_path))


def test_a_job_that_exits_non_zero_fails(
    project: Path, launcher: LocalLauncher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(project)
    launcher.options = LocalLauncherOptions(python=str(shutil.which("false")))
    handle = launcher.submit(LaunchRequest(config=Path("run.yaml"), run_dir=Path("jobs")))
    assert handle == str(project / "jobs" / "tiny")
    wait_for(lambda: launcher.status(handle) != "RUNNING", 30, "the job's end")
    assert launcher.status(handle) == "FAILED"
    assert launcher.status("jobs/tiny") == "FAILED"  # a relative folder works too
    record = json.loads((project / "jobs" / "tiny" / "job.json").read_text())
    assert record["command"][0] == shutil.which("false")
    assert json.loads((project / "jobs" / "tiny" / "exit.json").read_text())["returncode"] == 1

    # Submitting again keeps the earlier launch's files, the ups command's record among them.
    (project / "jobs" / "tiny" / "launch.json").write_text('{"format": 1}\n')
    handle = launcher.submit(LaunchRequest(config=Path("run.yaml"), run_dir=Path("jobs")))
    wait_for(lambda: launcher.status(handle) != "RUNNING", 30, "the second job's end")
    archived = list((project / "jobs" / "tiny" / "launches").iterdir())
    assert len(archived) == 1
    assert json.loads((archived[0] / "job.json").read_text()) == record
    assert (archived[0] / "launch.json").read_text() == '{"format": 1}\n'
    assert not (project / "jobs" / "tiny" / "launch.json").exists()


@pytest.mark.slow
def test_a_submitted_run_trains_to_success(project: Path, launcher: LocalLauncher) -> None:
    request = LaunchRequest(
        config=project / "run.yaml",
        nproc_per_node=2,
        overrides=("training.max_steps=3",),
        run_dir=project / "runs",
    )
    handle = launcher.submit(request)
    assert handle == str(project / "runs" / "tiny")
    record = json.loads((Path(handle) / "job.json").read_text())
    assert record["command_line"] == launcher.dry_run(request)
    assert record["log"] == str(Path(handle) / "launch.log")

    wait_for(lambda: launcher.status(handle) != "RUNNING", 120, "the run's end")
    text = launcher.logs(handle)
    assert launcher.status(handle) == "SUCCEEDED", text
    done = events(text, "done")
    assert done == [done[0]] and done[0]["steps"] == 3, text
    assert (project / "runs" / "tiny" / "checkpoints" / "step-3" / "COMMIT").is_file()
    wait_for(lambda: gone(record["pid"]), 10, "the runner's exit")


@pytest.mark.slow
def test_two_local_nodes_train_as_one_job_and_a_failing_node_fails_it(
    project: Path, launcher: LocalLauncher, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = LaunchRequest(
        config=project / "run.yaml",
        nnodes=2,
        nproc_per_node=1,
        overrides=("training.max_steps=3",),
        run_dir=project / "runs",
    )
    handle = launcher.submit(request)
    wait_for(lambda: launcher.status(handle) != "RUNNING", 120, "the run's end")
    text = launcher.logs(handle)
    assert launcher.status(handle) == "SUCCEEDED", text
    started = events(text, "training")
    assert len(started) == 1 and started[0]["world_size"] == 2, text  # one run, rank 0 logs
    done = events(text, "done")
    assert len(done) == 1 and done[0]["steps"] == 3, text

    # A rank of the second node fails at step 2 (an injected fault): so does the job, and the
    # first node's agent ends too.
    monkeypatch.setenv("UPS_FAULTS", "error@1:2")
    handle = launcher.submit(request)
    wait_for(lambda: launcher.status(handle) != "RUNNING", 120, "the failed run's end")
    text = launcher.logs(handle)
    assert launcher.status(handle) == "FAILED", text
    assert "injected" in text.lower(), text


@pytest.mark.slow
def test_cancel_stops_the_whole_job(project: Path, launcher: LocalLauncher) -> None:
    pids = project / "pids"
    pids.mkdir()
    request = LaunchRequest(
        config=project / "run.yaml",
        nproc_per_node=2,
        overrides=(
            "training.epochs=100000",
            "run.log_every=100000",
            f"model.options.pid_dir={pids}",
            "model.options.ignore_sigterm=true",  # so SIGKILL must finish the ranks
            "checkpoint.preempt_signals=[]",  # the engine would otherwise handle SIGTERM
        ),
        run_dir=project / "runs",
    )
    handle = launcher.submit(request)
    wait_for(lambda: len(list(pids.iterdir())) == 2, 120, "both ranks starting")
    ranks = [int(p.name) for p in pids.iterdir()]
    wait_for(lambda: all(map(ignores_sigterm, ranks)), 30, "both ranks ignoring SIGTERM")
    assert launcher.status(handle) == "RUNNING"
    leader = json.loads((Path(handle) / "job.json").read_text())["pid"]
    assert not any(gone(pid) for pid in [leader, *ranks])
    assert len(group_members(leader)) >= 2  # the runner and torch's agent
    with pytest.raises(UsageError, match="'tiny' is still running"):
        launcher.submit(request)

    started = time.monotonic()
    launcher.cancel(handle)
    assert time.monotonic() - started >= 2  # the grace period passed before SIGKILL
    assert launcher.status(handle) == "CANCELLED"
    assert all(gone(pid) for pid in [leader, *ranks])
    assert group_members(leader) == []  # nothing is left in the job's process group
    launcher.cancel(handle)  # cancelling an ended job changes nothing
    assert launcher.status(handle) == "CANCELLED"
