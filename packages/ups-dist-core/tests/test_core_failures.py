"""A failure on one rank becomes the same outcome on every rank, on real processes: an
out-of-memory step is skipped by all, any other error stops all, naming the rank."""

from __future__ import annotations

import gc
import os
import re
import sys
from pathlib import Path

import pytest

from ups.core import RunContext, UsageError, load_config, load_plugins, train
from ups.core.config._user_code import load_object
from ups.core.engine import train_rank
from ups.core.engine._faults import ENV, Fault, FaultInjector, parse_faults
from ups.core.testing import events, run_ranks, run_ups, tiny_project


def outcome(ctx: RunContext, config_path: Path) -> tuple[str, str]:
    """Train on this rank; return how it ended: ("ok", steps) or (exception class, message)."""
    try:
        result = train_rank(load_config(config_path), ctx, load_plugins())
    except Exception as error:
        return type(error).__name__, str(error)
    return "ok", str(result.steps)


def test_fault_specs_parse_and_bad_ones_name_the_item() -> None:
    assert parse_faults(" oom@1:3,4 ; error@0:7") == (
        Fault("oom", 1, frozenset({3, 4})),
        Fault("error", 0, frozenset({7})),
    )
    with pytest.raises(UsageError, match=r"UPS_FAULTS: bad item 'boom@1:3'; expected KIND@RANK"):
        parse_faults("oom@1:3;boom@1:3")
    assert parse_faults("kill@1:3;hang@0:2;kill_save@1:6") == (
        Fault("kill", 1, frozenset({3})),
        Fault("hang", 0, frozenset({2})),
        Fault("kill_save", 1, frozenset({6})),
    )
    with pytest.raises(UsageError, match="bad item 'oom@x:3'"):
        parse_faults("oom@x:3")


def test_an_injector_fires_only_on_its_rank_and_steps() -> None:
    env = {ENV: "oom@1:2;error@0:3"}
    injector = FaultInjector(1, env)
    injector.check(1)
    injector.check(3)
    with pytest.raises(RuntimeError, match="CUDA out of memory") as oom:
        injector.check(2)
    assert type(oom.value).__name__ == "OutOfMemoryError"
    injector.check(2)  # once a step: the step's later forward passes go on
    assert not FaultInjector(2, env)
    with pytest.raises(RuntimeError, match="injected error .* on rank 0 at step 3"):
        FaultInjector(0, env).check(3)
    FaultInjector(0, env, restart_count=1).check(3)  # a restarted job runs without faults


def test_a_save_without_a_kill_save_fault_leaves_fsync_alone() -> None:
    fsync = os.fsync
    with FaultInjector(1, {ENV: "kill_save@1:6;kill_save@0:3"}).saving(3):
        assert os.fsync is fsync
    assert os.fsync is fsync


@pytest.mark.slow
@pytest.mark.parametrize("static_graph", [False, True], ids=["plain", "static_graph"])
@pytest.mark.parametrize(
    "accumulation", [1, 2], ids=["in_the_ddp_forward", "in_a_local_micro_batch"]
)
def test_an_oom_on_one_rank_is_skipped_by_every_rank_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, static_graph: bool, accumulation: int
) -> None:
    monkeypatch.setenv(ENV, "oom@1:3")
    config = tiny_project(
        tmp_path,
        training={"epochs": 2, "accumulation_steps": accumulation, "skip_oom": True},
        distributed={"static_graph": static_graph},
        run={"log_every": 1},
    )
    result = train(config, nproc=2)
    # 64 samples, 2 ranks, batch 8: 8 micro-batches a rank over 2 epochs
    attempts = 8 // accumulation
    assert result.steps == attempts - 1
    skipped = [m["oom_skipped"] for m in result.metrics]
    assert skipped == [0, 0] + [1] * (attempts - 3)  # attempt 3 was skipped
    # The skipped step's micro-batches (8 samples on each rank) are not counted.
    assert sum(m["samples"] for m in result.metrics) == 2 * 64 - 16 * accumulation


@pytest.mark.slow
def test_repeated_ooms_stop_every_rank_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "oom@0:2,3")
    config = tiny_project(tmp_path, training={"epochs": 2, "skip_oom": True, "max_oom_skips": 1})
    ends = run_ranks(outcome, 2, config)
    message = (
        "step 2: out of memory on rank 0 2 times in a row (training.max_oom_skips: 1); "
        "lower training.batch_size (`ups tune` finds the largest that fits)"
    )
    assert ends == [("RankFailedError", message)] * 2


@pytest.mark.slow
def test_an_error_on_one_rank_stops_every_rank_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "error@1:3")
    config = tiny_project(tmp_path, training={"epochs": 2, "skip_oom": True})
    error = "injected error (injected by UPS_FAULTS on rank 1 at step 3)"
    assert run_ranks(outcome, 2, config) == [
        ("RankFailedError", f"step 3: rank 1: RuntimeError: {error}"),
        ("RuntimeError", error),  # the failed rank raises its own error
    ]


@pytest.mark.slow
@pytest.mark.parametrize("skip_oom", ["true", "auto"])
def test_the_cli_names_the_failed_rank_and_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip_oom: str
) -> None:
    monkeypatch.setenv(ENV, "error@1:2")
    config = tiny_project(tmp_path)
    run = run_ups("train", str(config), "--nproc", "2", "-o", f"training.skip_oom={skip_oom}")
    assert run.returncode == 1
    error = "RuntimeError: injected error (injected by UPS_FAULTS on rank 1 at step 2)"
    failed = [line for line in run.stderr.splitlines() if line.startswith("ups: rank ")]
    log_file = tmp_path / "runs" / "tiny" / "logs" / "rank1.jsonl"
    # the cause first; rank 0's error, which only repeats it, is left out
    assert failed[0] == f"ups: rank 1 failed: {error} (traceback: {log_file})"
    assert "Traceback" not in run.stderr  # rank 1's is in its log file:
    (failure,) = [e for e in events(log_file) if e["event"] == "failed"]
    assert failure["exception"].startswith("Traceback") and error in failure["exception"]
    if skip_oom == "true":  # agreed on: rank 0 names rank 1, which says nothing new
        assert len(failed) == 1, failed
    # auto, on CPU ranks: no agreement; rank 0 fails in its next collective, or the agent
    # stops it, promptly either way (run_ups has a timeout)


HOLDING_MODEL = '''
import weakref

import torch
from torch import nn

seen = []
"""Each training forward after the failed one: whether what the failed one held is alive."""


class Failing(nn.Module):
    """Runs out of memory in its third training forward, holding a tensor when it does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.attempts = 0
        self.held = None

    def forward(self, x):
        if self.training:
            self.attempts += 1
            if self.held is not None:
                seen.append(self.held() is not None)
            if self.attempts == 3:
                activations = torch.ones(1000)
                self.held = weakref.ref(activations)
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return self.net(x)


def build_model():
    return Failing()
'''


def test_a_skipped_step_frees_what_its_failed_forward_held_at_once(tmp_path: Path) -> None:
    """The failed forward's tensors go when every rank skips its step, before the allocator's
    cache is emptied: not when the garbage collector next breaks the cycle its traceback and
    the frame that caught it make (off here: the collector runs at unpredictable times)."""
    config = tiny_project(tmp_path, model={"factory": "holding.py:build_model"})
    (tmp_path / "holding.py").write_text(HOLDING_MODEL)
    factory = load_object(f"{tmp_path / 'holding.py'}:build_model", "model.factory")
    seen = sys.modules[factory.__module__].seen
    gc.disable()
    try:
        result = train(config, overrides=["training.skip_oom=true"])
    finally:
        gc.enable()
    assert (result.steps, result.metrics[-1]["oom_skipped"]) == (7, 1)
    assert seen == [False] * 5


BARRIER_METRICS = """
import torch.distributed as dist


def build(at):
    calls = []

    def metrics(outputs, targets):
        calls.append(1)
        if len(calls) == at and dist.get_rank() == 0:
            dist.barrier()  # rank 1 never enters it
        return {}

    return metrics
"""


@pytest.mark.slow
def test_a_collective_entered_by_one_rank_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "barrier_metrics.py").write_text(BARRIER_METRICS)
    config = tiny_project(
        tmp_path,
        metrics={"factory": "barrier_metrics.py:build", "options": {"at": 3}},
        distributed={"timeout_s": 2},
    )
    run = run_ups("train", str(config), "--nproc", "2", timeout=60)
    assert run.returncode == 1
    logs = tmp_path / "runs" / "tiny" / "logs"
    verdict = (
        "HangError: rank 0 waits in a collective (barrier) that rank 1 never entered: no "
        "progress for 2 s (distributed.timeout_s); rank 0 is after the forward pass of step 3, "
        "in user code called from metrics.factory, in barrier, while rank 1 waited in the "
        "backward pass of step 3"
    )
    failed = [line for line in run.stderr.splitlines() if line.startswith("ups: rank")]
    # both ranks' watchdogs say the same: once, with the lowest rank
    assert failed == [f"ups: rank 0 failed: {verdict} (traceback: {logs / 'rank0.jsonl'})"], (
        run.stderr[-3000:]
    )
    # Nothing else but the JSON log, and torch's C++ warnings, if any: no traceback
    other = [line for line in run.stderr.splitlines() if not line.startswith(("{", "ups: rank"))]
    assert all(re.match(r"\[rank\d\]:\[W", line) for line in other), run.stderr[-3000:]
    stuck = [e for e in events(logs / "rank0.jsonl") if e["event"] == "ranks stopped answering"]
    assert stuck[0]["error"] == verdict.removeprefix("HangError: ")
    assert "dist.barrier()" in stuck[0]["stack"]  # where rank 0 waits, in the user's code


STUCK_EVAL_DATA = """
import os
import time

import torch
from torch.utils.data import TensorDataset


class Stuck:
    \"\"\"16 samples of the tiny data; rank 0 never returns one (as a stuck loader worker).\"\"\"

    def __init__(self):
        x = torch.randn(16, 4)
        self.data = TensorDataset(x, x.sum(dim=1, keepdim=True))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        while os.environ["RANK"] == "0":
            time.sleep(1)
        return self.data[index]
"""


@pytest.mark.slow
def test_a_rank_stuck_reading_the_last_evaluation_is_named(tmp_path: Path) -> None:
    (tmp_path / "stuck.py").write_text(STUCK_EVAL_DATA)
    config = tiny_project(
        tmp_path,
        eval={"factory": "stuck.py:Stuck"},
        distributed={"timeout_s": 2},
    )
    run = run_ups("train", str(config), "--nproc", "2", timeout=60)
    assert run.returncode == 1
    verdict = (
        "HangError: rank 0 stopped answering: no progress for 2 s (distributed.timeout_s); "
        "rank 0 is at the end of step 4, while rank 1 waited in the evaluation after step 4"
    )
    failed = [line for line in run.stderr.splitlines() if line.startswith("ups: rank")]
    assert len(failed) == 1 and verdict in failed[0], run.stderr[-3000:]  # said alike: once
    logs = tmp_path / "runs" / "tiny" / "logs"
    stuck = [e for e in events(logs / "rank0.jsonl") if e["event"] == "ranks stopped answering"]
    assert "time.sleep(1)" in stuck[0]["stack"]  # where rank 0 is: reading the data


def test_bad_input_every_rank_builds_alike_is_rank_0s_error_on_every_rank(tmp_path: Path) -> None:
    """Every rank fails alike building its parts from bad input (which ``ups validate`` would
    have refused; a sweep's trial is not validated): rank 0 raises its own error, the others
    one naming it, so whichever rank exits first the launcher reports rank 0's error."""
    config = tiny_project(tmp_path, training={"optimizer": "no_such_optimizer"})
    rank_0, rank_1 = run_ranks(outcome, 2, config)
    assert rank_0[0] == "ConfigError" and "training.optimizer: unknown" in rank_0[1]
    assert rank_1 == ("RankUsageError", f"rank 0 failed: ConfigError: {rank_0[1]}")
