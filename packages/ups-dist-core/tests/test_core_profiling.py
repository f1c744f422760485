"""Profiling: torch.profiler traces of chosen steps and the communication profile, on real
2-rank gloo groups with a small DDP model; throughput maths and model counts on one process."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ups.core import RankFailedError, RunContext, UsageError
from ups.core.observe._profiling import (
    CommProfile,
    StepProfiler,
    comm_profile,
    model_counts,
    peak_memory_mb,
    throughput,
)
from ups.core.testing import run_ranks


class Regression(nn.Sequential):
    """A small model that says how to count its work."""

    tokens_per_sample = 8

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))

    def flops_per_sample(self) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


def train(model: nn.Module, steps: int, profiler: StepProfiler) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).sum().backward()
        optimizer.step()
        profiler.step()


def profile_ddp_steps(ctx: RunContext, folder: str) -> str | None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest's filterwarnings = error, in the child
        with StepProfiler(ctx, Path(folder), steps=2) as profiler:
            train(DistributedDataParallel(Regression()), 6, profiler)
    return None if profiler.trace is None else str(profiler.trace)


def event_names(trace: Path) -> set[str]:
    with trace.open() as file:
        return {event["name"] for event in json.load(file)["traceEvents"] if "name" in event}


@pytest.mark.slow
def test_each_rank_writes_a_trace_of_the_profiled_steps_only(tmp_path: Path) -> None:
    traces = run_ranks(profile_ddp_steps, 2, str(tmp_path))
    folder = tmp_path / "profile"
    assert traces == [str(folder / "rank0.json"), str(folder / "rank1.json")]
    assert sorted(path.name for path in folder.iterdir()) == ["rank0.json", "rank1.json"]
    for trace in folder.iterdir():
        names = event_names(trace)
        # Step 0 is skipped, step 1 warms up, 2 and 3 are recorded; then profiling stops.
        assert {n for n in names if n.startswith("ProfilerStep#")} == {
            "ProfilerStep#2",
            "ProfilerStep#3",
        }
        assert "aten::addmm" in names
        assert "[memory]" in names  # profile_memory
        assert any("allreduce" in n for n in names)  # DDP's gradient all-reduce


def test_a_trace_on_one_process(tmp_path: Path) -> None:
    with StepProfiler(RunContext(), tmp_path, steps=1) as profiler:
        train(Regression(), 5, profiler)
    assert profiler.trace == tmp_path / "profile" / "rank0.json"
    assert {n for n in event_names(profiler.trace) if n.startswith("ProfilerStep#")} == {
        "ProfilerStep#2"
    }


def test_training_that_ends_before_the_profile_writes_nothing_and_warns(tmp_path: Path) -> None:
    with (
        structlog.testing.capture_logs() as logs,
        StepProfiler(RunContext(), tmp_path, steps=3) as profiler,
    ):
        train(Regression(), 4, profiler)  # skipped, warm-up, 2 of the 3 steps asked for
    assert profiler.trace is None
    assert not (tmp_path / "profile").exists()
    assert logs == [
        {
            "event": "training ended before the profile did: no trace written",
            "log_level": "warning",
            "rank": 0,
            "profiled_steps": 2,
            "asked_steps": 3,
        }
    ]


def test_a_profile_of_no_steps_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="steps must be at least 1, not 0"):
        StepProfiler(RunContext(), tmp_path, steps=0)


def profile_comm(ctx: RunContext) -> tuple[CommProfile, tuple[float | None, float | None]]:
    ddp = DistributedDataParallel(Regression())
    inputs = torch.randn(16, 32)

    def step(sync: bool) -> None:
        ddp.zero_grad(set_to_none=True)
        model = ddp if sync else ddp.module  # the bare module runs no collective
        model(inputs).sum().backward()

    return comm_profile(ctx, step, iterations=3), model_counts(ddp)


@pytest.mark.slow
def test_every_rank_returns_the_same_comm_profile_of_every_rank() -> None:
    (profile, counts), (other, other_counts) = run_ranks(profile_comm, 2)
    assert profile == other
    assert profile.iterations == 3
    assert [r.rank for r in profile.ranks] == [0, 1]
    for r in profile.ranks:
        assert r.compute_s > 0
        assert r.total_s > 0
        assert r.comm_s == max(r.total_s - r.compute_s, 0.0)
        assert 0 <= r.comm_share <= 1
        assert r.peak_memory_mb > 0
    summary = profile.summary()
    assert summary["peak_memory_mb"] == max(r.peak_memory_mb for r in profile.ranks)
    assert 0 <= summary["comm_share"] <= summary["max_comm_share"] <= 1
    assert json.loads(json.dumps(profile.as_dict()))["ranks"][1]["rank"] == 1
    # Read through DDP's wrapper: 6 * (32 * 64 + 64 + 64 + 1) parameters.
    assert counts == other_counts == (6.0 * 2177, 8.0)


def test_comm_profile_on_one_process() -> None:
    calls: list[bool] = []
    profile = comm_profile(RunContext(), calls.append, iterations=4)
    assert calls == [False] * 5 + [True] * 5  # a warm-up step, then the timed ones
    (mine,) = profile.ranks
    assert mine.rank == 0
    assert profile.as_dict()["summary"] == profile.summary()


def test_a_failing_step_fails_the_comm_profile_naming_the_rank() -> None:
    def step(sync: bool) -> None:
        if sync:
            raise ValueError("no targets")

    with pytest.raises(RankFailedError, match=r"^comm_profile \(sync=True\): rank 0: ValueError"):
        comm_profile(RunContext(), step)


def test_peak_memory_of_this_process() -> None:
    assert peak_memory_mb(torch.device("cpu")) > 1  # an interpreter with torch loaded


def test_throughput() -> None:
    assert throughput(640, 2.0, world_size=2) == {"samples_per_s": 320.0}
    assert throughput(
        640,
        2.0,
        world_size=2,
        flops_per_sample=3e9,
        tokens_per_sample=128,
        peak_flops=1.2e12,
    ) == {"samples_per_s": 320.0, "tokens_per_s": 40960.0, "tflops": 0.96, "mfu": 0.4}
    assert throughput(10, 1.0, world_size=1, flops_per_sample=1e12) == {
        "samples_per_s": 10.0,
        "tflops": 10.0,
    }
    with pytest.raises(ValueError, match="seconds must be positive"):
        throughput(10, 0.0, world_size=1)


class Counted(nn.Linear):
    flops_per_sample = 1e6


class CountedBadly(nn.Linear):
    def tokens_per_sample(self) -> str:
        return "many"


def test_model_counts() -> None:
    assert model_counts(nn.Linear(2, 2)) == (None, None)
    assert model_counts(Counted(2, 2)) == (1e6, None)
    with pytest.raises(
        UsageError, match=r"^CountedBadly.tokens_per_sample must be a positive number"
    ):
        model_counts(CountedBadly(2, 2))
