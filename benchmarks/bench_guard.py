"""Benchmark the training guard (``training.guard: {action: skip, spike: 10}``, clipping off)
and the step timing of the straggler report (``run.straggler_threshold``, on by default) in
one process, against the same run without them.

Two measurements:

engine
    The tiny project of :func:`ups.core.testing.tiny_project` (a 4-8-1 MLP, batches of 8: the
    engine's own time dominates its steps) trained by :func:`ups.core.train` on one process
    for ``--steps`` steps, reporting every ``--steps / 10``: a run's time per step is the median
    of its reports' ``step_time_s`` after the first report (start-up left out). Rounds alternate
    which run goes first; reported per round, then as the median (min to max): µs per step
    without and with the guard and their difference (both timed), and without the timing
    (``run.straggler_threshold: null``, no guard) and the difference the timing makes; and
    with the rollback guard (``action: rollback``, its snapshot every 50 steps, the default).
added work alone
    What the guard adds to a step, timed alone over 2000 calls on the gradients of the
    operator example's FNO (``examples/pde_operator``, 24 tensors): ``Strategy.grad_norm``
    (``torch.nn.utils.get_total_norm``, then ``float``) and ``Guard.check`` (all it adds when
    ``training.grad_clip_norm`` computes the norm already); and the step timer's boundaries
    of a step (:class:`~ups.core.observe._phases.StepTimer`: the 6 a step of one micro-batch
    marks on CPU, and its ``take`` at a report every 10 steps) against the ``NoTimer`` an
    untimed run calls; and the copies a rollback snapshot makes of the FNO's model and its
    AdamW state (every ``snapshot_every`` steps, so a 50th of it a step at the default).

Usage: ``python benchmarks/bench_guard.py [--rounds N] [--steps N] [--out FILE]``
(``nox -s bench_guard`` runs it). Prints a Markdown table and writes a JSON file (default
``.nox-reports/bench_guard.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
import torch
from bench_ema import batch, build_model
from torch import nn

from ups.core import Config, RunContext, load_config, train
from ups.core.config._config import GuardConfig
from ups.core.engine._guard import Guard
from ups.core.engine._strategy import Strategy
from ups.core.observe._phases import (
    BACKWARD,
    COLLECTIVES,
    DATA,
    FORWARD,
    OPTIMIZER,
    NoTimer,
    StepTimer,
)
from ups.core.testing import tiny_project

ROOT = Path(__file__).resolve().parents[1]
GUARD = {"action": "skip", "spike": 10.0}
ROLLBACK = {"action": "rollback", "spike": 10.0}
"""The rollback guard, its snapshot every ``snapshot_every`` steps at the default (50)."""


def engine_us(folder: Path, guard: dict[str, Any] | None, steps: int, *, timed: bool) -> float:
    """Microseconds per step of the engine on the tiny project, with ``guard`` or without,
    its steps ``timed`` (the straggler report) or not."""
    every = max(1, steps // 10)
    path = tiny_project(
        folder,
        run={"log_every": every, "straggler_threshold": 0.2 if timed else None},
        data={"options": {"n": 8 * steps}},
        training={"max_steps": steps, "guard": guard},
    )
    result = train(path)
    times = [m["step_time_s"] for m in result.metrics[1:]]
    return statistics.median(times) * 1e6


def added_us(config: Config, calls: int) -> tuple[float, float]:
    """Microseconds per ``Strategy.grad_norm`` (the ``ddp`` strategy's, for ``config``) and
    per ``Guard.check`` on the FNO's gradients."""
    model = build_model()
    u0, params, target = batch(model)
    nn.functional.mse_loss(model(u0, params), target).backward()
    strategy = Strategy(RunContext(), config)
    guard = Guard(GuardConfig(spike=10.0), RunContext(), scaled=False)
    start = time.perf_counter()
    for _ in range(calls):
        norm = strategy.grad_norm(model.parameters())
    norm_us = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for _ in range(calls):
        guard.check(norm)
    return norm_us, (time.perf_counter() - start) / calls * 1e6


def snapshot_us(copies: int) -> float:
    """Microseconds per copy of the FNO's model and AdamW state as a snapshot takes them
    (``state_dict()`` tensors cloned, the optimizer's deep-copied), after one step."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    u0, params, target = batch(model)
    nn.functional.mse_loss(model(u0, params), target).backward()
    optimizer.step()
    start = time.perf_counter()
    for _ in range(copies):
        {k: v.detach().clone() for k, v in model.state_dict().items()}
        copy.deepcopy(optimizer.state_dict())
    return (time.perf_counter() - start) / copies * 1e6


def timer_us(timer: StepTimer, steps: int) -> float:
    """Microseconds per step of ``timer``'s boundaries of a step of one micro-batch on CPU, and
    a ``take`` every 10 steps."""
    start = time.perf_counter()
    for step in range(steps):
        for phase in (DATA, FORWARD, COLLECTIVES, BACKWARD, OPTIMIZER):
            timer.enter(phase)
        timer.stop()
        if step % 10 == 0:
            timer.take()
    return (time.perf_counter() - start) / steps * 1e6


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f} to {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_guard.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    settings = {
        "plain": (None, True),
        "guard": (GUARD, True),
        "rollback": (ROLLBACK, True),
        "untimed": (None, False),
    }
    runs: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            turn = round_ % len(settings)
            order = list(settings)[turn:] + list(settings)[:turn]
            for index, name in enumerate(order):
                guard, timed = settings[name]
                where = Path(folder) / f"{round_}-{index}"
                runs[name].append(engine_us(where, guard, args.steps, timed=timed))
        norm_us, check_us = added_us(load_config(tiny_project(Path(folder) / "fno")), 2000)
    plain, guarded, untimed = runs["plain"], runs["guard"], runs["untimed"]
    added = [g - p for g, p in zip(guarded, plain, strict=True)]
    rolled = [r - p for r, p in zip(runs["rollback"], plain, strict=True)]
    snapshot = snapshot_us(200)
    timing = [p - u for p, u in zip(plain, untimed, strict=True)]
    timer, no_timer = timer_us(StepTimer(torch.device("cpu")), 20000), timer_us(NoTimer(), 20000)
    result = {
        "machine": platform.platform(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "steps": args.steps,
        "plain_us": plain,
        "guard_us": guarded,
        "added_us": added,
        "rollback_us": runs["rollback"],
        "rollback_added_us": rolled,
        "snapshot_us": snapshot,
        "untimed_us": untimed,
        "timing_us": timing,
        "timer_us": timer,
        "no_timer_us": no_timer,
        "grad_norm_us": norm_us,
        "check_us": check_us,
    }
    print(f"tiny project, one process, 1 thread, {args.steps} steps a run\n")
    print("| measure | median (min to max) |\n|---|---|")
    print(f"| engine step without the guard (timed), µs | {summary(plain)} |")
    print(f"| engine step with the guard (skip, spike: 10; timed), µs | {summary(guarded)} |")
    print(f"| added by the guard, µs/step | {summary(added)} |")
    print(
        f"| engine step with the rollback guard (snapshot every 50; timed), µs | {summary(runs['rollback'])} |"
    )
    print(f"| added by the rollback guard, µs/step | {summary(rolled)} |")
    print(
        f"| a snapshot's copies alone (FNO and AdamW), µs; per step at every 50 | {snapshot:.1f}; {snapshot / 50:.1f} |"
    )
    print(f"| `Strategy.grad_norm` alone (FNO, 24 tensors), µs/call | {norm_us:.1f} |")
    print(f"| `Guard.check` alone, µs/call | {check_us:.2f} |")
    print(f"| engine step without the timing (no guard), µs | {summary(untimed)} |")
    print(f"| added by the timing, µs/step | {summary(timing)} |")
    print(f"| the step timer's boundaries alone, µs/step | {timer:.2f} |")
    print(f"| the untimed run's `NoTimer` alone, µs/step | {no_timer:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
