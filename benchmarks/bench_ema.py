"""Benchmark the EMA of the weights (``training.ema``, :class:`ups.core.EMA`) at
``every_steps: 1``, in one process, against the same steps without it.

The model is the operator example's FNO (``examples/pde_operator/fno.py``, the example's
options: about 0.3 M parameters in 24 tensors), trained on random batches of 16 (AdamW, MSE),
one intra-op thread. A round times ``--steps`` steps without the EMA, then ``--steps`` with it
(``ema.update(step)`` after ``optimizer.step()``, as the engine does), each with
``time.perf_counter`` after ``--warmup`` untimed steps; the rounds alternate which goes first.
Reported, per round then as the median (min, max) over the rounds: the microseconds per step
without and with the EMA, their difference and ratio, and ``ema.update`` timed alone (µs a
call, and per parameter) against the same update as a Python loop of ``lerp_`` over the tensors.

Usage: ``python benchmarks/bench_ema.py [--rounds N] [--steps N] [--out FILE]``
(``nox -s bench_ema`` runs it). Prints a Markdown table and writes a JSON file (default
``.nox-reports/bench_ema.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ups.core import EMA

ROOT = Path(__file__).resolve().parents[1]
FNO = ROOT / "examples" / "pde_operator" / "fno.py"


def build_model() -> nn.Module:
    """The operator example's model, with the example config's options."""
    spec = importlib.util.spec_from_file_location("bench_fno", FNO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model: nn.Module = module.build_model(width=20, modes=8, layers=3, params=4)
    return model


def batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs and targets of the model's shapes (a 32 x 32 grid, 4 parameters)."""
    generator = torch.Generator().manual_seed(0)
    u0 = torch.randn(16, 1, 32, 32, generator=generator)
    params = torch.randn(16, 4, generator=generator)
    return u0, params, model(u0, params).detach().clone().normal_(generator=generator)


def steps_us(with_ema: bool, steps: int, warmup: int) -> float:
    """Microseconds per training step over ``steps`` timed steps, with or without the EMA."""
    torch.manual_seed(0)
    model = build_model()
    u0, params, target = batch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = EMA(model, 0.999) if with_ema else None
    start = 0.0
    for step in range(1, warmup + steps + 1):
        if step == warmup + 1:
            start = time.perf_counter()
        loss = nn.functional.mse_loss(model(u0, params), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if ema is not None:
            ema.update(step)
    return (time.perf_counter() - start) / steps * 1e6


def update_us(calls: int) -> tuple[float, float, int]:
    """Microseconds per ``ema.update`` call alone, per the same update written as a Python loop
    of ``lerp_`` over the tensors, and the model's parameter count."""
    model = build_model()
    ema = EMA(model, 0.999)
    live = [t.detach() for t in model.state_dict().values()]
    kept = [t.clone() for t in live]
    for step in range(1, 51):
        ema.update(step)
    start = time.perf_counter()
    for step in range(51, 51 + calls):
        ema.update(step)
    foreach = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(calls):
            for average, weights in zip(kept, live, strict=True):
                average.lerp_(weights, 0.001)
    loop = (time.perf_counter() - start) / calls * 1e6
    return foreach, loop, sum(p.numel() for p in model.parameters())


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f} to {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_ema.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain: list[float] = []
    ema: list[float] = []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for with_ema in order:
            (ema if with_ema else plain).append(steps_us(with_ema, args.steps, args.warmup))
    alone, loop, parameters = update_us(2000)
    added = [e - p for e, p in zip(ema, plain, strict=True)]
    ratios = [e / p for e, p in zip(ema, plain, strict=True)]
    result: dict[str, Any] = {
        "machine": platform.platform(),
        "torch": torch.__version__,
        "parameters": parameters,
        "rounds": args.rounds,
        "steps": args.steps,
        "plain_us": plain,
        "ema_us": ema,
        "added_us": added,
        "ratio": ratios,
        "update_alone_us": alone,
        "python_loop_us": loop,
    }
    print(f"FNO of {parameters:,} parameters, one process, 1 thread, {args.steps} steps a run\n")
    print("| measure | median (min to max) |\n|---|---|")
    print(f"| step without EMA, µs | {summary(plain)} |")
    print(f"| step with EMA (every_steps: 1), µs | {summary(ema)} |")
    print(f"| added by the EMA, µs/step | {summary(added)} |")
    print(
        f"| ratio with/without | {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f} to {max(ratios):.3f}) |"
    )
    print(
        f"| `ema.update` alone, µs/call | {alone:.1f} ({alone / parameters * 1e3:.2f} ns/param) |"
    )
    print(f"| the same as a Python loop of `lerp_`, µs/call | {loop:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
