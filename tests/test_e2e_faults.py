"""Fault tolerance end to end: kill any rank, lose nothing, finish bitwise equal.

Real processes under ``ups train``'s elastic agent (and torchrun across two network
namespaces); CPU training is deterministic, so "equal" is to the bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_e2e_resume import final_state, project

from ups.core.testing import assert_bitwise_equal, free_port

EXIT_PREEMPTED = 75

MODEL = """
import os
import pathlib
import time

import torch
from torch import nn


def build_model(pid_dir=None, seen_dir=None, delay=0.0):
    '''The dropout model of test_e2e_resume. ``pid_dir``: each rank writes its pid there;
    ``seen_dir``: each process appends the first input of every training sample it takes to a
    file there; ``delay``: seconds each training forward pass sleeps (a slower run).'''
    if pid_dir:
        pathlib.Path(pid_dir, str(os.getpid())).touch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1))

    def pre_forward(module, args):
        if module.training and seen_dir:
            with open(pathlib.Path(seen_dir, f"{os.getpid()}.txt"), "a") as seen:
                seen.writelines(f"{value!r}\\n" for value in args[0][:, 0].tolist())
        if module.training and delay:
            time.sleep(delay)

    model.register_forward_pre_hook(pre_forward)
    return model
"""

STEPS = 24
"""3 epochs of 8 steps: 64 samples in batches of 4 on 2 ranks."""


def faults_project(folder: Path, **options: Any) -> Path:
    """``test_e2e_resume``'s project (``simple`` checkpoints every 3 steps, keep 5) for all
    24 steps, with :data:`MODEL`."""
    return project(folder, STEPS, "none", model=MODEL, model_options=options or None)


def ups_train(
    config: Path, *args: str, nproc: int = 2, faults: str = "", timeout: float = 120
) -> Any:
    """``ups train CONFIG --nproc NPROC ARGS`` with ``UPS_FAULTS=faults``, logging JSON."""
    env = {**os.environ, "UPS_LOG_FORMAT": "json", "UPS_FAULTS": faults}
    command = [sys.executable, "-m", "ups.core", "train", str(config), f"--nproc={nproc}", *args]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def run_dir(config: Path) -> Path:
    return config.parent / "runs" / "tiny"


def final(config: Path) -> dict[str, Any]:
    """The state of the run's newest checkpoint."""
    newest = max((run_dir(config) / "checkpoints").glob("step-*.pt"))
    return final_state(SimpleNamespace(checkpoint=str(newest)))


def events(config: Path, name: str, rank: int = 0) -> list[dict[str, Any]]:
    """Every ``name`` event of the rank's log, across restarts."""
    lines = (run_dir(config) / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def assert_equal_to(reference: dict[str, Any], config: Path) -> None:
    found = final(config)
    for key in ("model", "optimizer", "scheduler", "step", "epoch", "rng", "ranks"):
        assert_bitwise_equal(found[key], reference[key], key)


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Return once ``condition()`` holds; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stepping(config: Path) -> Callable[[], bool]:
    """Whether rank 0 has logged a training report."""
    log = run_dir(config) / "logs" / "rank0.jsonl"
    return lambda: log.is_file() and '"event": "step"' in log.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final state of an uninterrupted run."""
    config = faults_project(tmp_path_factory.mktemp("whole"))
    done = ups_train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    state = final(config)
    assert state["step"] == STEPS
    return state


_trials = random.Random(8)
KILLS = [(_trials.randrange(2), _trials.randrange(2, STEPS)) for _ in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "step"), KILLS)
def test_kill_9_of_one_worker_at_a_random_step_restarts_and_ends_bitwise_equal(
    tmp_path: Path, reference: dict[str, Any], rank: int, step: int
) -> None:
    config = faults_project(tmp_path)
    done = ups_train(config, "--max-restarts", "1", faults=f"kill@{rank}:{step}")
    assert done.returncode == 0, done.stderr[-3000:]
    saved = (step - 1) // 3 * 3  # the newest checkpoint (every 3 steps) before the kill
    resumed = [e["step"] for e in events(config, "resumed")]
    assert resumed == ([saved] if saved else []), done.stderr[-6000:]
    assert_equal_to(reference, config)


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_resumes_from_the_previous_one(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Rank 0 dies with the file of step 6 written, not renamed into place: the restarted run
    resumes from step 3's and still ends bitwise equal. (ups-ckpt's tests kill its backends
    at every step of their commit.)"""
    config = faults_project(tmp_path)
    done = ups_train(config, "--max-restarts", "1", faults="kill_save@0:6")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["step"] for e in events(config, "resumed")] == [3]
    # What the killed save left: step 6's whole file, fsynced, never renamed into place.
    (left,) = (run_dir(config) / "checkpoints").glob(".tmp-*.pt")
    assert torch.load(left, weights_only=True)["state"]["step"] == 6
    assert_equal_to(reference, config)


@pytest.mark.slow
def test_a_sigterm_to_a_worker_saves_at_the_next_step_and_the_resumed_run_ends_equal(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    config = faults_project(tmp_path, pid_dir=str(pids), delay=0.05)
    env = {**os.environ, "UPS_LOG_FORMAT": "json"}
    command = [sys.executable, "-m", "ups.core", "train", str(config), "--nproc", "2"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as process:
        wait_for(stepping(config), 60, "a training report")
        worker = max(int(p.name) for p in pids.iterdir())
        os.kill(worker, signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = events(config, "preempted: saving and stopping")[0]["step"]
    assert f"ups: preempted: the ranks saved at step {stopped}; resume with" in err
    assert 0 < stopped < STEPS
    assert final(config)["step"] == stopped
    done = ups_train(config, "-o", "checkpoint.resume=latest")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_equal_to(reference, config)


@pytest.mark.slow
def test_a_rank_asleep_in_a_step_stops_every_rank_within_the_timeout_naming_it(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    config = faults_project(tmp_path, pid_dir=str(pids))
    timeout_s = 10
    started = time.monotonic()
    done = ups_train(
        config, "-o", f"distributed.timeout_s={timeout_s}", faults="hang@1:3", timeout=90
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-3000:]
    assert "rank 1 stopped answering" in done.stderr, done.stderr[-3000:]
    assert "rank 1 is in the forward pass of step 3" in done.stderr
    assert elapsed < timeout_s + 30, f"took {elapsed:.0f} s"
    for pid in (int(p.name) for p in pids.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_a_run_started_on_2_ranks_and_resumed_on_1_sees_every_remaining_sample_once(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    config = project(
        tmp_path, 5, "latest", "tensor", model=MODEL, model_options={"seen_dir": str(first)}
    )
    assert ups_train(config).returncode == 0
    seen = ["-o", f"model.options.seen_dir={second}", "-o", "training.epochs=1"]
    rest = ups_train(config, "-o", "training.max_steps=null", *seen, nproc=1)
    assert rest.returncode == 0, rest.stderr[-3000:]

    def values(folder: Path) -> list[str]:
        return [line for p in folder.iterdir() for line in p.read_text().splitlines()]

    before, after = values(first), values(second)
    assert len(before) == 5 * 2 * 4
    everything = set(before) | set(after)
    assert len(everything) == 64  # the 64 samples' first inputs are distinct
    assert sorted(after) == sorted(everything - set(before))  # the rest, each exactly once


@contextlib.contextmanager
def two_machines(tag: str) -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair: 10.77.0.1 and 10.77.0.2 on ``eth-<tag>``
    devices; deleted again, whatever happened."""
    names = (f"ups-{tag}-a", f"ups-{tag}-b")
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(
            ["ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"],
            check=True,
        )
        for i, (name, end) in enumerate(zip(names, "ab", strict=True), start=1):
            device = f"v{tag}{end}"
            for command in (
                ["ip", "link", "set", device, "netns", name],
                ["ip", "-n", name, "addr", "add", f"10.77.0.{i}/24", "dev", device],
                ["ip", "-n", name, "link", "set", device, "up"],
                ["ip", "-n", name, "link", "set", "lo", "up"],
            ):
                subprocess.run(command, check=True)
        yield names
    finally:
        for name in names:
            kill_all_in(name)
            subprocess.run(["ip", "netns", "delete", name], check=False)


def kill_all_in(namespace: str) -> None:
    """SIGKILL every process of ``namespace`` (a machine lost)."""
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.slow
def test_two_machines_one_lost_the_job_restarts_and_finishes(tmp_path: Path) -> None:
    config = faults_project(tmp_path, delay=0.1)
    port, tag = free_port(), f"{os.getpid() % 100000}"
    # Torch's agents share one store across rounds unless told not to; a node that joins
    # afresh then waits for a key of the first round (see docs/fault-tolerance.md).
    env = {
        **os.environ,
        "UPS_LOG_FORMAT": "json",
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    started: list[subprocess.Popen[str]] = []

    def machine(namespace: str, node: int) -> subprocess.Popen[str]:
        command = [
            *("ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run"),
            *("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"10.77.0.1:{port}"),
            *("--rdzv-id", f"ups-{tag}", "--rdzv-conf", f"is_host={int(node == 1)}"),
            *("--local-addr", f"10.77.0.{node}", "--monitor-interval", "0.1"),
            *("-m", "ups.core", "train", str(config)),
        ]
        with (tmp_path / f"{namespace}.log").open("a") as logged:
            started.append(
                subprocess.Popen(
                    command,
                    stdout=logged,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**env, "GLOO_SOCKET_IFNAME": f"v{tag}{'ab'[node - 1]}"},
                )
            )
        return started[-1]

    try:
        with two_machines(tag) as (one, two):
            first = machine(one, 1)
            lost = machine(two, 2)
            checkpoints = run_dir(config) / "checkpoints"
            wait_for(lambda: any(checkpoints.glob("step-*.pt")), 120, "a checkpoint")
            kill_all_in(two)
            lost.wait(timeout=30)
            back = machine(two, 2)  # the machine comes back, as a node would
            assert first.wait(timeout=150) == 0, (tmp_path / f"{one}.log").read_text()[-3000:]
            assert back.wait(timeout=30) == 0, (tmp_path / f"{two}.log").read_text()[-3000:]
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert final(config)["step"] == STEPS
    assert events(config, "resumed")[0]["step"] >= 3, "the restarted job did not resume"
