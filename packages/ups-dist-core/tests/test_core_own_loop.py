"""The parts of ups.core a loop of one's own uses, on real gloo ranks, built with nothing but the
run context: ``decide``, per-task loss aggregation, the preemption handler and the step watchdog
with their defaults; and none of them imports the engine."""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import ConfigError, LossWindow, Preemption, RunContext, Watchdog, decide
from ups.core.testing import counting_all_reduces, run_ranks

ENGINE = ("ups.core.engine._run", "ups.core.engine._update", "ups.core.engine._resume")
"""Modules only the engine needs (the ranks here run under ``ups.core.testing``, which imports
``ups.core.launch._processes`` for ``free_port``; tests/test_own_loop_imports.py checks a user's process,
which imports neither)."""


def _loop(ctx: RunContext) -> dict[str, Any]:
    window = LossWindow(("a", "b"), ctx.device)
    stopped_at = None
    with (
        counting_all_reduces() as checks,
        Preemption(ctx) as preemption,  # SIGTERM, SIGUSR1
        Watchdog(ctx) as watchdog,
    ):
        for step in range(1, 2000):
            watchdog.mark(step)
            time.sleep(0.002 * (1 + ctx.rank))  # steps of 2 ms on rank 0, 4 ms on rank 1
            # rank r: task a's losses are r, task b's 10 + r
            window.add(torch.tensor([ctx.rank, 10.0 + ctx.rank]), torch.tensor([0, 1]))
            if step == 20 and ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if preemption.agreed():
                stopped_at = step
                break
    return {
        "decided": decide(ctx, lambda: f"rank {ctx.rank} decided"),
        "metrics": window.report(ctx).result(),
        "stopped_at": stopped_at,
        "checks": checks[0],
        "engine": [name for name in ENGINE if name in sys.modules],
    }


@pytest.mark.slow
def test_the_own_loop_parts_with_their_defaults_and_without_the_engine() -> None:
    results = run_ranks(_loop, 2)
    stopped_at = results[0]["stopped_at"]
    # on every rank at the same step, within two checks (about 0.1 s of 4 ms steps apart)
    assert all(result["stopped_at"] == stopped_at for result in results)
    assert 20 < stopped_at < 20 + 2 * 0.1 / 0.004 + 20
    # not an all-reduce a step: about one every 0.1 s (25 steps of rank 1), after the first two
    assert all(2 < result["checks"] <= 3 + stopped_at // 12 for result in results)
    for result in results:
        assert result["decided"] == "rank 0 decided"
        # two ranks: a's mean (0 + 1) / 2, b's (10 + 11) / 2
        samples = 4 * stopped_at
        assert result["metrics"] == {"loss": 5.5, "loss/a": 0.5, "loss/b": 10.5, "samples": samples}
        assert result["engine"] == []


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match=r"^tasks: expected a list of task names, got 'ab'$"):
        LossWindow("ab", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^signals: must be signals .*, not 'SIGTERM'$"):
        Preemption(RunContext(), ["SIGTERM"])  # type: ignore[list-item]


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.tuples(st.floats(0, 10), st.integers(0, 2)), min_size=1, max_size=5),
        min_size=1,
        max_size=40,
    ),
    cut=st.integers(0, 40),
    means=st.booleans(),
)
def test_a_window_saved_between_reports_reports_as_an_unbroken_one(
    batches: list[list[tuple[float, int]]], cut: int, means: bool
) -> None:
    ctx = RunContext()

    def add(window: LossWindow, batch: list[tuple[float, int]]) -> None:
        losses = torch.tensor([loss for loss, _ in batch])
        if means:  # a step whose loss is the batch's mean
            window.add_mean(losses.mean(), len(batch))
        else:
            window.add(losses, torch.tensor([task for _, task in batch]))

    unbroken = LossWindow(("a", "b", "c"), ctx.device)
    for batch in batches:
        add(unbroken, batch)
    first = LossWindow(("a", "b", "c"), ctx.device)
    for batch in batches[:cut]:
        add(first, batch)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    resumed = LossWindow(("a", "b", "c"), ctx.device)
    add(resumed, [(99.0, 0)])  # what it held before loading is replaced
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    for batch in batches[cut:]:
        add(resumed, batch)
    expected = unbroken.report(ctx).result()  # a task without samples: nan in both
    assert resumed.report(ctx).result() == pytest.approx(expected, rel=1e-12, nan_ok=True)


def test_a_window_refuses_a_state_saved_with_other_tasks() -> None:
    state = LossWindow(("a", "b"), torch.device("cpu")).state_dict()
    with pytest.raises(ConfigError, match=r"tasks: the saved window has tasks \['a', 'b'\]"):
        LossWindow(("a", "c"), torch.device("cpu")).load_state_dict(state)
