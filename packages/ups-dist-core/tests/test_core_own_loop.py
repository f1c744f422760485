"""The parts of ups.core a loop of one's own uses, on real gloo ranks, built with nothing but the
run context: ``decide``, per-task loss aggregation, the preemption handler and the step watchdog
with their defaults; and none of them imports the engine."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import pytest
import torch

from ups.core import ConfigError, LossWindow, Preemption, RunContext, Watchdog, decide
from ups.core.testing import run_ranks

ENGINE = ("ups.core.engine", "ups.core.stepping", "ups.core.resume")
"""Modules only the engine needs (the ranks here run under ``ups.core.testing``, which imports
``ups.core.launch`` for ``free_port``; tests/test_own_loop_imports.py checks a user's process,
which imports neither)."""


def _loop(ctx: RunContext) -> dict[str, Any]:
    window = LossWindow(("a", "b"), ctx.device)
    stopped_at = None
    with Preemption(ctx) as preemption, Watchdog(ctx) as watchdog:  # SIGTERM, SIGUSR1
        for step in range(1, 10):
            watchdog.mark(step)
            # rank r: task a's losses are r, task b's 10 + r
            window.add(torch.tensor([ctx.rank, 10.0 + ctx.rank]), torch.tensor([0, 1]))
            if step == 2 and ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if preemption.agreed():
                stopped_at = step
                break
    return {
        "decided": decide(ctx, lambda: f"rank {ctx.rank} decided"),
        "metrics": window.report(ctx).result(),
        "stopped_at": stopped_at,
        "engine": [name for name in ENGINE if name in sys.modules],
    }


@pytest.mark.slow
def test_the_own_loop_parts_with_their_defaults_and_without_the_engine() -> None:
    for result in run_ranks(_loop, 2):
        assert result["decided"] == "rank 0 decided"
        # steps 1-3 on two ranks: a's mean (0 + 1) / 2, b's (10 + 11) / 2
        assert result["metrics"] == {"loss": 5.5, "loss/a": 0.5, "loss/b": 10.5, "samples": 12}
        assert result["stopped_at"] == 3  # one step after the signal, on every rank
        assert result["engine"] == []


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match=r"^tasks: expected a list of task names, got 'ab'$"):
        LossWindow("ab", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^signals: 'SIGTERM' is not a signal; allowed: "):
        Preemption(RunContext(), ["SIGTERM"])  # type: ignore[list-item]
