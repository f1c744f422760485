"""Fault tolerance end to end: kill any rank, lose nothing, finish bitwise equal.

Real processes under ``ups train``'s elastic agent (and torchrun across two network
namespaces); CPU training is deterministic, so "equal" is to the bit.
"""

from __future__ import annotations

import contextlib
import datetime
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
import yaml
from test_e2e_resume import final_state, project

from ups.core.dist._context import collective_timeout
from ups.core.testing import (
    assert_bitwise_equal,
    events,
    free_port,
    install_plugin,
    kill_all_in,
    run_ups,
    tiny_project,
    two_machines,
    wait_for,
)

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

SCHEDULE = [
    {"when": {"at_latest_step": 5}, "do": {"lr_multiplier": 0.5}},
    {"when": {"at_latest_step": 10}, "do": {"accumulation_steps": 2}},
]
"""Two decisions: the LR halved after step 5, micro-batches taken 2 at a time after step 10."""

POWERSGD = {
    "name": "powersgd",
    "options": {
        "matrix_approximation_rank": 1,
        "start_powersgd_iter": 2,
        "min_compression_rate": 0.5,
    },
}
"""Compressing (each rank's error feedback a state of its own) from the second step."""

STEPS = 17
"""3 epochs of 8 batches (64 samples in batches of 4 on 2 ranks): 8 steps, then 2 + 6 / 2, then
8 / 2 (:data:`SCHEDULE`)."""


def faults_project(folder: Path, **options: Any) -> Path:
    """``test_e2e_resume``'s project (``simple`` checkpoints every 3 steps, keep 5) for all
    :data:`STEPS`, with :data:`MODEL`, and every part of the state a resume restores: the
    ``tensor`` sampler (its position in the epoch), a StepLR scheduler, :data:`SCHEDULE`'s
    decisions and :data:`POWERSGD`."""
    config = project(
        folder,
        STEPS,
        "none",
        "tensor",
        model=MODEL,
        model_options=options or None,
        comm_hook=POWERSGD,
        scheduler="StepLR",
        scheduler_options={"step_size": 4, "gamma": 0.7},
    )
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "schedule": SCHEDULE}))
    return config


def watched_project(folder: Path, **options: Any) -> tuple[Path, Path]:
    """:func:`faults_project` whose ranks write their pids into ``folder/pids``; return the
    config and that folder."""
    pids = folder / "pids"
    pids.mkdir()
    return faults_project(folder, pid_dir=str(pids), **options), pids


def ups_train(
    config: Path, *args: str, nproc: int = 2, faults: str = "", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``ups train CONFIG --nproc NPROC ARGS`` with ``UPS_FAULTS=faults``."""
    train = ("train", str(config), f"--nproc={nproc}", *args)
    return run_ups(*train, env={"UPS_FAULTS": faults}, timeout=timeout)


def run_dir(config: Path) -> Path:
    return config.parent / "runs" / "tiny"


def final(config: Path) -> dict[str, Any]:
    """The state of the run's newest checkpoint."""
    newest = max((run_dir(config) / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    return final_state(SimpleNamespace(checkpoint=str(newest)))


def rank_log(config: Path, rank: int = 0) -> Path:
    """The rank's log file, across restarts."""
    return run_dir(config) / "logs" / f"rank{rank}.jsonl"


STATE = (
    *("model", "optimizer", "scheduler", "scaler", "schedule", "sampler"),
    *("step", "epoch", "epoch_left", "rng", "ranks"),
)
"""The training state in a checkpoint (``ranks``: each rank's generators and comm hook state)."""


def assert_equal_to(reference: dict[str, Any], config: Path) -> None:
    found = final(config)
    for key in STATE:
        assert_bitwise_equal(found[key], reference[key], key)


def fired_at(config: Path, rank: int) -> float:
    """When (``time.time()``) the fault injected on ``rank`` fired."""
    (fault,) = events(rank_log(config, rank), "fault injected")
    return datetime.datetime.fromisoformat(fault["timestamp"]).timestamp()


def assert_all_gone_within(seconds: float, config: Path, rank: int, pids: Path) -> None:
    """Every rank (their pids in ``pids``) has exited, within ``seconds`` of ``rank``'s fault."""
    took = time.time() - fired_at(config, rank)
    assert took < seconds, f"the ranks took {took:.1f} s to stop"
    for pid in (int(p.name) for p in pids.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def stepping(config: Path) -> Callable[[], bool]:
    """Whether rank 0 has logged a training report."""
    log = rank_log(config)
    return lambda: log.is_file() and '"event": "step"' in log.read_text()


def preempted(config: Path, pids: Path) -> tuple[int, str]:
    """``ups train CONFIG --nproc 2``, one of its ranks (their pids in ``pids``) sent SIGTERM
    once rank 0 has reported: the exit status and the standard error."""
    env = {**os.environ, "UPS_LOG_FORMAT": "json"}
    command = [sys.executable, "-m", "ups.core", "train", str(config), "--nproc", "2"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as process:
        wait_for(stepping(config), 60, "a training report", process=process)
        os.kill(max(int(p.name) for p in pids.iterdir()), signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    return process.returncode, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final state of an uninterrupted run."""
    config = faults_project(tmp_path_factory.mktemp("whole"))
    done = ups_train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    state = final(config)
    assert state["step"] == STEPS
    # Every part of the state is one a resume must restore, not its initial value.
    assert [fired["rule"] for fired in state["schedule"]["fired"]] == [0, 1]
    assert state["scheduler"]["last_epoch"] == STEPS
    assert state["sampler"]
    assert all(own["comm_hook"]["error_dict"] for own in state["ranks"])
    return state


_trials = random.Random(8)
KILLS = [
    (0, _trials.randrange(4, 10), "kill"),  # resumed before the schedule's second decision
    (1, _trials.randrange(11, STEPS + 1), "kill"),  # after both
    (_trials.randrange(2), _trials.randrange(4, STEPS + 1), "kill_backward"),
]
"""(rank, step, fault): each after the first checkpoint (step 3), so that the job resumes."""


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "step", "fault"), KILLS)
def test_kill_9_of_one_worker_at_a_random_step_restarts_and_ends_bitwise_equal(
    tmp_path: Path, reference: dict[str, Any], rank: int, step: int, fault: str
) -> None:
    config = faults_project(tmp_path)
    done = ups_train(config, "--max-restarts", "1", faults=f"{fault}@{rank}:{step}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["step"] for e in events(rank_log(config, rank), "fault injected")] == [step]
    saved = (step - 1) // 3 * 3  # the newest checkpoint (every 3 steps) before the kill
    assert [e["step"] for e in events(rank_log(config), "resumed")] == [saved], done.stderr[-6000:]
    assert_equal_to(reference, config)


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_resumes_from_the_previous_one(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Rank 0 dies with step 6's ``state.pt`` written in its temporary folder, uncommitted:
    the restarted run resumes from step 3's, sweeps that folder at its first save and still
    ends bitwise equal. (ups-ckpt's tests kill the protocol at every step of its commit.)"""
    config = faults_project(tmp_path)
    done = ups_train(config, "--max-restarts", "1", faults="kill_save@0:6")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["step"] for e in events(rank_log(config), "resumed")] == [3]
    assert [e["step"] for e in events(rank_log(config), "fault injected")] == [6]
    assert not list((run_dir(config) / "checkpoints").glob(".tmp-*"))  # swept
    assert_equal_to(reference, config)


@pytest.mark.slow
def test_a_sigterm_to_a_worker_saves_at_the_next_step_and_the_resumed_run_ends_equal(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    config, pids = watched_project(tmp_path, delay=0.2)
    returncode, err = preempted(config, pids)
    assert returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = events(rank_log(config), "preempted: saving and stopping")[0]["step"]
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
    config, pids = watched_project(tmp_path)
    timeout_s = 10
    done = ups_train(
        config, "-o", f"distributed.timeout_s={timeout_s}", faults="hang@1:3", timeout=90
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "rank 1 stopped answering" in done.stderr, done.stderr[-3000:]
    assert "rank 1 is in the forward pass of step 3" in done.stderr
    # timeout_s, a watchdog poll, up to half the grace waiting for the marks, the agent's stop:
    # within the process group's timeout (timeout_s and the grace) and a margin.
    assert_all_gone_within(collective_timeout(timeout_s) + 5, config, 1, pids)


@pytest.mark.slow
def test_an_error_on_one_rank_stops_every_rank_long_before_the_timeout_naming_it(
    tmp_path: Path,
) -> None:
    config, pids = watched_project(tmp_path)
    done = ups_train(config, "-o", "distributed.timeout_s=120", faults="error@1:4")
    assert done.returncode == 1, done.stderr[-3000:]
    error = "RuntimeError: injected error (injected by UPS_FAULTS on rank 1 at step 4)"
    assert f"ups: rank 1 failed: {error}" in done.stderr, done.stderr[-3000:]
    # Rank 0, in the backward's all-reduce, sees its peer gone (or the agent stops it).
    assert_all_gone_within(20, config, 1, pids)


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


class Machines:
    """torchrun agents of one rank each training ``config`` on the two "machines" of
    :func:`~ups.core.testing.two_machines` (``names``, made with ``tag``), meeting at a c10d
    rendezvous that machine 1 hosts: ``--nnodes nnodes``, ``--max-restarts 1``, and the
    rendezvous's options ``rdzv_conf`` (``key=value,...``) besides ``is_host``."""

    def __init__(
        self, config: Path, names: tuple[str, str], tag: str, nnodes: str, rdzv_conf: str
    ) -> None:
        self.config, self.names, self.tag = config, names, tag
        self.nnodes, self.rdzv_conf, self.port = nnodes, rdzv_conf, free_port()
        self.started: list[subprocess.Popen[str]] = []

    def log(self, node: int) -> Path:
        """What machine ``node``'s agents and ranks wrote (appended across its starts)."""
        return self.config.parent / f"{self.names[node - 1]}.log"

    def start(self, node: int) -> subprocess.Popen[str]:
        """Start machine ``node``'s (1 or 2) agent."""
        conf = ",".join(filter(None, [f"is_host={int(node == 1)}", self.rdzv_conf]))
        command = [
            *("ip", "netns", "exec", self.names[node - 1]),
            *(sys.executable, "-m", "torch.distributed.run"),
            *("--nnodes", self.nnodes, "--nproc-per-node", "1", "--max-restarts", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"10.77.0.1:{self.port}"),
            *("--rdzv-id", f"ups-{self.tag}", "--rdzv-conf", conf),
            *("--local-addr", f"10.77.0.{node}", "--monitor-interval", "0.1"),
            *("-m", "ups.core", "train", str(self.config)),
        ]
        # Torch's agents share one store across rounds unless told not to; a node that joins
        # afresh then waits for a key of the first round (see docs/fault-tolerance.md).
        env = {
            **os.environ,
            "UPS_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "GLOO_SOCKET_IFNAME": f"v{self.tag}{'ab'[node - 1]}",
        }
        with self.log(node).open("a") as logged:
            started = subprocess.Popen(
                command, stdout=logged, stderr=subprocess.STDOUT, text=True, env=env
            )
        self.started.append(started)
        return started

    def lose(self, node: int, process: subprocess.Popen[str]) -> None:
        """SIGKILL every process of machine ``node`` (its agent ``process`` included)."""
        kill_all_in(self.names[node - 1])
        process.wait(timeout=30)

    def assert_finished(self, node: int, process: subprocess.Popen[str], seconds: float) -> None:
        """Machine ``node``'s agent ``process`` exits 0 within ``seconds``."""
        assert process.wait(timeout=seconds) == 0, self.log(node).read_text()[-3000:]


@contextlib.contextmanager
def machines(config: Path, nnodes: str, rdzv_conf: str = "") -> Iterator[Machines]:
    """:class:`Machines` on two fresh namespaces; every agent started is killed on leaving."""
    tag = f"{os.getpid() % 100000}"  # apart from concurrent tests' namespaces
    with two_machines(tag) as names:
        found = Machines(config, names, tag, nnodes, rdzv_conf)
        try:
            yield found
        finally:
            for process in found.started:
                if process.poll() is None:
                    process.kill()
                process.wait()


def wait_for_a_checkpoint(config: Path) -> None:
    checkpoints = run_dir(config) / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*/COMMIT")), 120, "a checkpoint")


@pytest.mark.slow
def test_two_machines_one_lost_the_job_restarts_and_finishes(tmp_path: Path) -> None:
    config = faults_project(tmp_path, delay=0.1)
    with machines(config, "2") as two:
        first = two.start(1)
        lost = two.start(2)
        wait_for_a_checkpoint(config)
        two.lose(2, lost)
        back = two.start(2)  # the machine comes back, as a node would
        two.assert_finished(1, first, 150)
        two.assert_finished(2, back, 30)
    assert final(config)["step"] == STEPS
    assert events(rank_log(config), "resumed")[0]["step"] >= 3, "the restarted job did not resume"


SHRINK = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2"
"""A rendezvous of ``--nnodes 1:2`` quick to shrink (torch's defaults take 15 s and 30 s): a
node without a heartbeat for 2 s is dropped from it, and a round that has 1 node completes
3 s later unless the second joins (then at once: the first round, both machines started)."""


@pytest.mark.slow
def test_an_elastic_job_that_lost_a_machine_for_good_resumes_on_1_rank_and_sees_every_sample_once(
    tmp_path: Path,
) -> None:
    """torchrun ``--nnodes 1:2`` on two machines; the second is lost after the first checkpoint
    and never comes back: the first's agent meets again alone, its rank resumes the epoch from
    the checkpoint on world size 1 and takes, exactly once, each sample that the 2 ranks had
    not taken by the checkpoint's step (what they took after it, before the loss, is redone)."""
    seen = tmp_path / "seen"
    seen.mkdir()
    options = {"seen_dir": str(seen), "delay": 0.2}
    config = project(
        tmp_path, None, "latest", "tensor", model=MODEL, model_options=options, epochs=1
    )
    with machines(config, "1:2", SHRINK) as two:
        lost = two.start(2)  # waits for the host: both meet in the first round's last call
        survivor = two.start(1)
        wait_for_a_checkpoint(config)
        first_ranks = sorted(seen.iterdir())  # each rank of the 2 wrote its samples by now
        two.lose(2, lost)
        two.assert_finished(1, survivor, 120)
    (resumed,) = events(rank_log(config), "resumed")
    saved_at = resumed["step"]
    assert saved_at in (3, 6), resumed  # a checkpoint mid-epoch (8 steps of 2 batches of 4)
    assert [e["world_size"] for e in events(rank_log(config), "training")] == [2, 1]
    (changed,) = events(
        rank_log(config),
        "checkpoint saved by another number of ranks: each rank's "
        "generators start from rank 0's and the comm hook's state starts afresh",
    )
    assert changed["saved_world_size"] == 2
    assert [
        e["restarts"] for e in events(rank_log(config), "restarted by the launcher: resuming")
    ] == [1]

    def lines(path: Path) -> list[str]:
        return path.read_text().splitlines()

    assert len(first_ranks) == 2
    taken = [value for path in first_ranks for value in lines(path)[: 4 * saved_at]]
    assert len(set(taken)) == 2 * 4 * saved_at
    (after,) = set(seen.iterdir()) - set(first_ranks)  # the resumed rank
    everything = set(taken) | set(lines(after))
    assert len(everything) == 64  # the 64 samples' first inputs are distinct
    assert sorted(lines(after)) == sorted(everything - set(taken))  # the rest, each exactly once


KILL_AT_END = """
import os
import signal

from ups.core import hookimpl


@hookimpl
def ups_run_end(ctx, result):
    if ctx.rank == 1 and ctx.restart_count == 0:  # after the final save, in the first start
        os.kill(os.getpid(), signal.SIGKILL)
"""
"""A plugin that SIGKILLs rank 1 as its run ends, as a worker lost during teardown is."""


@pytest.mark.slow
def test_a_worker_killed_after_the_final_save_restarts_into_a_complete_run_and_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_project(
        tmp_path / "project",
        training={"batch_size": 4},
        checkpoint={"every_steps": 7},
        distributed={"timeout_s": 30},
    )
    install_plugin(tmp_path, "ups-kill-at-end", "ups_kill_at_end", KILL_AT_END)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [path])]))
    done = ups_train(config, "--max-restarts", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    # Restarted once, into the complete run: every rank resumed at the end and said so.
    for rank in (0, 1):
        assert [e["step"] for e in events(rank_log(config, rank), "resumed")] == [8]
        assert events(
            rank_log(config, rank), "the run is complete at step 8: nothing left to train"
        )
