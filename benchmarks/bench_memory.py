"""What each rank holds under the sharded strategies (ups-fsdp's ``zero`` and ``fsdp``) against
``ddp`` in the same run, on local CPU ranks (gloo).

A stack of ``Linear(width, width)`` blocks in an ``nn.Sequential`` (``--params``, about 50 M by
default: 12 blocks of width 2040) is trained by the engine (``ups.core.train(config,
nproc=W)``, AdamW, batch 4 per rank, no evaluation, no checkpoint but the engine's final one)
for ``--warmup`` + ``--steps`` steps under each strategy (``ddp``, ``zero``, ``fsdp``, and
``fsdp`` with ``reshard_after_forward: false``) at each of ``--worlds`` (2 and 4 ranks).

Measured inside each rank, without touching the engine: the model factory (this file's
:func:`build_model`) keeps the model it built and registers global optimizer step hooks. After
each step (the outermost optimizer's: ``zero``'s ``ZeroRedundancyOptimizer`` steps an inner
optimizer over the rank's share, whose state is the one held), the rank counts the bytes of the
storages its tensors hold, each storage once (a DTensor's local shard): the model's parameters,
their ``.grad``, and every tensor of the optimizers' ``state`` (the outer one's and the inner
one's). At the last timed step (so before the final checkpoint's gathering), the peak resident
set (``ru_maxrss``), then the resident set once glibc has given the heap's free memory back to
the system (``malloc_trim(0)``): what the rank's live tensors, the interpreter and torch take,
without the freed buffers (all-gathers, reduce-scatters) the allocator keeps. And the wall time
of each step after the warm-up (from one step's end to the next's). DDP's bucket copy of the
gradients is in the resident sets, not in the counted bytes.

Reported per strategy and number of ranks: the counted bytes (the largest rank's) and their
ratio to ``ddp``'s at the same number of ranks, against the targets of the sharded strategies
(:data:`TARGETS`); both resident sets (the largest rank's) and their ratios; the median step
time (over the timed steps of every rank) and its ratio. Every rank runs one intra-op thread;
Linux with glibc.

Usage: ``python benchmarks/bench_memory.py [--params N] [--steps N] [--worlds 2,4]``
(``nox -s bench_memory`` runs it; a quick check: ``-- --params 2000000 --steps 2``). Prints a
Markdown table and writes ``.nox-reports/bench_memory.json`` (the ranks' logs:
``.nox-reports/bench_memory.log``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import resource
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import TensorDataset

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
LAYERS = 12
BATCH = 4
MIB = 2**20
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "zero": {"name": "zero"},
    "fsdp": {"name": "fsdp"},
    "fsdp, reshard_after_forward: false": {
        "name": "fsdp",
        "options": {"reshard_after_forward": False},
    },
}
"""The runs of each number of ranks, by label: ``strategy`` sections."""
TARGETS: dict[tuple[str, int], float] = {
    ("fsdp", 2): 0.55,
    ("fsdp", 4): 0.30,
    ("fsdp, reshard_after_forward: false", 2): 0.55,
    ("zero", 2): 0.78,
    ("zero", 4): 0.65,
}
"""The most each may hold of ``ddp``'s parameter, gradient and optimizer bytes (AdamW: 4P)."""


# ---------------------------------------------------------------------------------------------
# Inside the ranks


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages ``tensors`` (a DTensor: its local shard) hold, each once."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def rss_mib(field: str) -> float:
    """This process's ``VmRSS`` or ``VmHWM`` (``/proc/self/status``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise LookupError(field)


class Probe:
    """Global optimizer step hooks: after each outermost step, the bytes held (see the module's
    docstring) and the step's wall time; at the last timed step, this rank's record goes to
    ``out/rank{R}.json``."""

    def __init__(
        self, model: nn.Module, start_rss_mib: float, out: str, warmup: int, steps: int
    ) -> None:
        self.model, self.out, self.warmup, self.steps = model, Path(out), warmup, steps
        self.start_rss_mib = start_rss_mib
        self.depth = 0
        self.inner: list[torch.optim.Optimizer] = []
        self.count = 0
        self.last = 0.0
        self.step_s: list[float] = []
        self.held: dict[str, int] = {}

    def before(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.depth += 1

    def after(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.depth -= 1
        if self.depth:  # an optimizer stepped by another (zero's local one): counted with it
            self.inner.append(optimizer)
            return
        now = time.perf_counter()
        self.count += 1
        if self.count > self.warmup:
            self.step_s.append(now - self.last)
        self.count_held([optimizer, *self.inner])
        self.inner.clear()
        if self.count == self.warmup + self.steps:
            self.write()
        self.last = time.perf_counter()

    def count_held(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The bytes held now by each kind of tensor and by all (a storage counted once); the
        largest of the steps so far."""
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [
            value
            for optimizer in optimizers
            for per_param in optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ]
        now = {
            "params": held_bytes(params),
            "grads": held_bytes(grads),
            "optimizer_state": held_bytes(state),
            "total": held_bytes([*params, *grads, *state]),
        }
        self.held = {kind: max(value, self.held.get(kind, 0)) for kind, value in now.items()}

    def write(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ctypes.CDLL(None).malloc_trim(0)  # glibc: give the heap's free memory back first
        record = {
            "rank": rank,
            "held_bytes": self.held,
            "start_rss_mib": self.start_rss_mib,
            "peak_rss_mib": peak,
            "trimmed_rss_mib": rss_mib("VmRSS"),
            "step_s": self.step_s,
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))


def build_model(width: int, layers: int, probe: dict[str, Any]) -> nn.Module:
    """``layers`` blocks of ``Linear(width, width)`` and ``Tanh``, with a :class:`Probe`
    (``probe``: its ``out``, ``warmup`` and ``steps``) watching every optimizer step."""
    start_rss_mib = rss_mib("VmRSS")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*blocks)
    watch = Probe(model, start_rss_mib, **probe)
    register_optimizer_step_pre_hook(watch.before)
    register_optimizer_step_post_hook(watch.after)
    return model


def build_dataset(width: int, n: int) -> TensorDataset:
    """``n`` random inputs and targets of ``width`` features."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(n, width, generator=generator)
    return TensorDataset(inputs, torch.rand(n, width, generator=generator) - 0.5)


# ---------------------------------------------------------------------------------------------
# The driver


def config(
    folder: Path, strategy: dict[str, Any], world: int, width: int, warmup: int, steps: int
) -> dict[str, Any]:
    """The run of one strategy on ``world`` ranks, its files and the ranks' records under
    ``folder``."""
    probe = {"out": str(folder), "warmup": warmup, "steps": steps}
    return {
        "run": {"name": "memory", "output_dir": str(folder / "runs"), "log_every": 1000},
        "model": {
            "factory": f"{HERE}:build_model",
            "options": {"width": width, "layers": LAYERS, "probe": probe},
        },
        "data": {
            "factory": f"{HERE}:build_dataset",
            "options": {"width": width, "n": BATCH * world * (warmup + steps)},
        },
        "training": {
            "epochs": 1,
            "max_steps": warmup + steps,
            "batch_size": BATCH,
            "optimizer": "adamw",
            "lr": 1e-4,
        },
        "distributed": {"backend": "gloo"},
        "checkpoint": {"every_steps": None},
        "strategy": strategy,
    }


def measure(
    strategy: dict[str, Any], world: int, width: int, warmup: int, steps: int, log: Path
) -> dict[str, Any]:
    """Train one strategy on ``world`` ranks; the ranks' records, summed up (or the error)."""
    from bench_engine import stderr_to

    from ups.core import train

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            with stderr_to(log):
                train(config(folder, strategy, world, width, warmup, steps), nproc=world)
        except Exception as error:  # a strategy that fails is reported, the others still run
            return {"error": f"{type(error).__name__}: {error}"}
        ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    return {
        "held_bytes": max(r["held_bytes"]["total"] for r in ranks),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "trimmed_rss_mib": max(r["trimmed_rss_mib"] for r in ranks),
        "step_s": statistics.median(s for r in ranks for s in r["step_s"]),
        "ranks": ranks,
    }


def width_for(params: int) -> int:
    """The width (a multiple of 8) whose :data:`LAYERS` blocks hold about ``params``."""
    return max(8, int(math.sqrt(params / LAYERS)) // 8 * 8)


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the rows, ratios to ``ddp``'s row of the same number of ranks."""
    lines = [
        "| strategy | ranks | params + grads + optimizer state, MiB/rank | x ddp | target "
        "| peak RSS, MiB | x ddp | RSS after, trimmed, MiB | x ddp | step, s | x ddp |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        head = f"| {row['strategy']} | {row['world']} "
        if "error" in row:
            lines.append(head + f"| failed: {cause(row['error'])} |" + " |" * 8)
            continue
        target = row.get("target")
        verdict = "" if target is None else f"<= {target} ({'met' if row['met'] else 'NOT met'})"
        cells = [f"{row['held_bytes'] / MIB:.1f}", ratio(row, "held_bytes"), verdict]
        for key, digits in (("peak_rss_mib", 0), ("trimmed_rss_mib", 0), ("step_s", 3)):
            cells += [f"{row[key]:.{digits}f}", ratio(row, key)]
        lines.append(head + "| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cause(error: str) -> str:
    """The last line of a rank's traceback in ``error`` (a ``ChildFailedError``'s text): the
    exception raised."""
    lines = [line.strip() for line in error.splitlines()]
    return [line for line in lines if line and not line.startswith("=")][-1][:300]


def ratio(row: dict[str, Any], key: str) -> str:
    value = row.get("x_ddp", {}).get(key)
    return "" if value is None else f"{value:.3f}"


def main() -> None:
    from _stats import source_state

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="about this many")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--worlds", default="2,4", help="numbers of ranks, comma-separated")
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_memory.json")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    width = width_for(args.params)
    params = LAYERS * (width * width + width)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    log.write_text("")
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.worlds.split(",")):
        baseline: dict[str, Any] = {}
        for label, strategy in STRATEGIES.items():
            started = time.perf_counter()
            row: dict[str, Any] = {"strategy": label, "world": world}
            row |= measure(strategy, world, width, args.warmup, args.steps, log)
            row["wall_s"] = time.perf_counter() - started
            if label == "ddp":
                baseline = row
            if "error" not in row and "error" not in baseline:
                keys = ("held_bytes", "peak_rss_mib", "trimmed_rss_mib", "step_s")
                row["x_ddp"] = {key: row[key] / baseline[key] for key in keys}
                target = TARGETS.get((label, world))
                if target is not None:
                    row |= {"target": target, "met": row["x_ddp"]["held_bytes"] <= target}
            rows.append(row)
            print(f"{label} on {world} ranks: {row.get('error', 'done')} ({row['wall_s']:.0f} s)")
    print(
        f"\n{params:,} parameters ({LAYERS} x Linear({width}, {width})), AdamW, batch {BATCH} "
        f"per rank, gloo, 1 thread a rank; {args.warmup} + {args.steps} steps\n"
    )
    print(table(rows))
    report = {
        "machine": platform.platform(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "parameters": params,
        "width": width,
        "layers": LAYERS,
        "batch": BATCH,
        "warmup": args.warmup,
        "steps": args.steps,
        "loadavg": os.getloadavg(),
        "rows": rows,
        "source": source_state(
            "packages/ups-dist-core/src", "packages/ups-fsdp/src", "benchmarks/bench_memory.py"
        ),
    }
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
