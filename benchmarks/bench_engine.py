"""Benchmark the ups engine against a hand-written DDP loop, on local CPU ranks (gloo).

Three measurements, each against a baseline taken in the same run:

throughput
    The bundled example (``examples/pde_multitask``) trained on 2 ranks (a) by the engine
    (``ups.core.launch._processes.run_processes(train_here, config)``, what ``ups.core.train`` does) and
    (b) by a plain DDP loop: same model, data, ``DistributedSampler``, batch size, optimizer and
    steps, started by the same ``run_processes``. A probe built by the model factory (the same
    on both sides) times steps ``warmup+1 .. warmup+steps`` with ``time.perf_counter`` through a
    global optimizer step post-hook, with a barrier every ``segment`` steps, so neither start-up
    nor the end (final checkpoint, teardown) is timed. A run's rate is its median segment (robust
    to a burst of other load on the machine); the whole window is reported too. Runs alternate
    engine, plain, plain, engine, ...; the engine/plain ratio is taken per round, then its
    median, min and max. The same on 1 rank (no DDP on either side).
time to first step
    Wall time from starting ``ups train CONFIG --nproc 2`` as a subprocess until rank 0's first
    optimizer step is done, against ``torchrun --standalone --nproc-per-node 2`` running the plain
    loop of this file; alternated too.
scaling
    The engine's samples/s on 1 and 2 ranks (same per-rank batch): speedup and efficiency.

Every rank uses one intra-op thread (``OMP_NUM_THREADS=1``, as torchrun sets it).

Usage: ``python benchmarks/bench_engine.py [--repeats N] [--steps N] [--out FILE]``
(``nox -s bench`` runs it). Prints a Markdown table and writes a JSON file (default
``.nox-reports/bench_engine.json``); the ranks' logs go next to it (``bench_engine.log``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import operator
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, DistributedSampler

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "pde_multitask.py"
EXAMPLE_CONFIG = ROOT / "examples" / "pde_multitask.yaml"


# ---------------------------------------------------------------------------------------------
# Inside the ranks: the probe (both sides) and the hand-written loop


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("bench_pde_multitask", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Probe:
    """A global optimizer step post-hook: stamps the first step's wall time, and times steps
    ``warmup+1 .. warmup+steps`` between barriers, one every ``segment`` steps. Rank 0 writes
    what it saw to ``out``."""

    def __init__(self, out: str, warmup: int, steps: int, segment: int = 0) -> None:
        self.out, self.warmup, self.steps = out, warmup, steps
        self.segment = segment or steps
        self.count = 0
        self.stamps: list[float] = []
        self.record: dict[str, Any] = {}

    def __call__(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.count += 1
        if self.count == 1:
            self.record["first_step_unix"] = time.time()
            self._write()
        timed = self.count - self.warmup
        if self.steps and 0 <= timed <= self.steps and timed % self.segment == 0:
            if dist.is_initialized():
                dist.barrier()
            self.stamps.append(time.perf_counter())
            if timed == self.steps:
                world = dist.get_world_size() if dist.is_initialized() else 1
                self.record.update(
                    steps=self.steps,
                    segment=self.segment,
                    seconds=self.stamps[-1] - self.stamps[0],
                    segments=[b - a for a, b in itertools.pairwise(self.stamps)],
                    world_size=world,
                )
                self._write()

    def _write(self) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            Path(self.out).write_text(json.dumps(self.record))


def timed_model(probe: dict[str, Any], **options: Any) -> nn.Module:
    """The example's model, with a :class:`Probe` on every optimizer of this process."""
    register_optimizer_step_post_hook(Probe(**probe))
    return _example().build_model(**options)  # type: ignore[no-any-return]


def plain_train(rank: int, world_size: int, config: dict[str, Any]) -> None:
    """The hand-written DDP loop: what the engine does for this config, and nothing else."""
    t = config["training"]
    torch.manual_seed(config["run"]["seed"])
    model = timed_model(**config["model"]["options"])
    dataset = _example().build_dataset(**config["data"]["options"])
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=config["run"]["seed"]
    )
    loader = DataLoader(dataset, batch_size=t["batch_size"], sampler=sampler)
    ddp = DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.AdamW(
        ddp.parameters(), lr=t["lr"], weight_decay=t.get("weight_decay", 0.0)
    )
    step = 0
    ddp.train()
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for inputs, targets, _task in loader:
            loss = nn.functional.mse_loss(ddp(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step >= t["max_steps"]:
                return


def plain_here(ctx: Any, config: dict[str, Any]) -> None:
    """:func:`plain_train` as a ``run_processes`` function (the same start-up as the engine)."""
    plain_train(ctx.rank, ctx.world_size, config)


def plain_torchrun(config_path: str) -> None:
    """:func:`plain_train` under ``torchrun``: join the process group torchrun describes."""
    config = yaml.safe_load(Path(config_path).read_text())
    dist.init_process_group("gloo")
    try:
        plain_train(dist.get_rank(), dist.get_world_size(), config)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The driver


def write_config(
    folder: Path, name: str, *, max_steps: int, probe: dict[str, int], overrides: list[str]
) -> Path:
    """The example's config with ``overrides``, the probe in the model factory, steps capped,
    no checkpoints but the final one (the hand-written loop has none), its files under
    ``folder``."""
    from ups.core.config._config import apply_overrides

    config = apply_overrides(yaml.safe_load(EXAMPLE_CONFIG.read_text()), overrides)
    out = folder / f"{name}.probe.json"
    config["run"].update(name=name, output_dir=str(folder / "runs"))
    config["model"]["factory"] = f"{HERE}:timed_model"
    config["model"]["options"]["probe"] = {"out": str(out), **probe}
    config["data"]["factory"] = f"{EXAMPLE}:build_dataset"
    config.pop("eval", None)  # the hand-written loop does not evaluate
    config["training"].update(epochs=10**6, max_steps=max_steps)
    config["distributed"].update(backend="gloo")
    config["checkpoint"]["every_steps"] = None
    config["sampler"] = {"name": "torch"}  # the hand-written loop's DistributedSampler
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def stderr_to(log: Path) -> Iterator[None]:
    """Send this process's stderr (and so its children's) to ``log`` for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("ab") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def probe_result(config_path: Path) -> dict[str, Any]:
    config = yaml.safe_load(config_path.read_text())
    out = Path(config["model"]["options"]["probe"]["out"])
    record: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return record


def throughput_run(side: str, config_path: Path, nproc: int, log: Path) -> dict[str, float]:
    """One run of one side: steps/s over the whole timed window and the median over its
    segments (robust to a burst of other load on the machine), and samples/s (all ranks)."""
    from ups.core import load_config
    from ups.core.launch._processes import run_processes, train_here

    config = load_config(config_path)
    with stderr_to(log):
        if side == "engine":
            run_processes(train_here, config, nproc=nproc, distributed=config.distributed)
        else:
            plain = yaml.safe_load(config_path.read_text())
            run_processes(plain_here, plain, nproc=nproc, distributed=config.distributed)
    record = probe_result(config_path)
    rate = record["segment"] / statistics.median(record["segments"])
    batch = config.training.batch_size * record["world_size"]
    return {
        "steps_per_s": rate,
        "samples_per_s": rate * batch,
        "window_steps_per_s": record["steps"] / record["seconds"],
    }


def first_step_run(side: str, config_path: Path, log: Path) -> dict[str, float]:
    """Seconds from starting the command to rank 0's first step done, and to its exit."""
    bin_dir = Path(sys.executable).parent
    if side == "engine":
        command = [str(bin_dir / "ups"), "train", str(config_path), "--nproc", "2"]
    else:
        command = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2"]
        command += [str(HERE), "--plain-worker", str(config_path)]
    with log.open("ab") as sink:
        started = time.time()
        subprocess.run(command, check=True, stdout=sink, stderr=sink, cwd=config_path.parent)
        ended = time.time()
    record = probe_result(config_path)
    return {"first_step_s": record["first_step_unix"] - started, "exit_s": ended - started}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def alternate(
    rounds: int,
    run: Callable[[str], dict[str, float]],
    label: str,
    sides: tuple[str, ...] = ("engine", "plain"),
) -> dict[str, list[dict[str, float]]]:
    """``rounds`` rounds of every side, in order and reversed in turn; each result carries the
    1-minute load average before its run."""
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for i in range(rounds):
        for side in sides if i % 2 == 0 else sides[::-1]:
            load = os.getloadavg()[0]
            results[side].append({**run(side), "load_1min": load})
            shown = ", ".join(f"{k} {v:.2f}" for k, v in results[side][-1].items())
            print(f"  {label} {i + 1}/{rounds} {side:12}: {shown}", flush=True)
    return results


def compare(
    runs: dict[str, list[dict[str, float]]], key: str, how: Callable[[float, float], float]
) -> dict[str, Any]:
    """Per round, ``how(engine, plain)`` of ``key``; its median, min and max, and the sides'
    medians."""
    values = [how(e[key], p[key]) for e, p in zip(runs["engine"], runs["plain"], strict=True)]
    return {
        "engine": statistics.median(e[key] for e in runs["engine"]),
        "plain": statistics.median(p[key] for p in runs["plain"]),
        "per_round": values,
        **summary(values),
    }


def source_state() -> dict[str, str]:
    """The commit measured, and whether the core's sources differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    changed = git("status", "--porcelain", "--", "packages/ups-dist-core/src")
    return {"commit": git("rev-parse", "--short", "HEAD"), "core_changes": changed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="rounds of the 2-rank pair")
    parser.add_argument("--steps", type=int, default=600, help="timed steps per run")
    parser.add_argument("--segment", type=int, default=100, help="steps per timed segment")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timed window")
    parser.add_argument("--scaling-repeats", type=int, default=3, help="rounds on 1 rank")
    parser.add_argument("--first-step-repeats", type=int, default=3)
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a value of the engine's config, e.g. -o training.skip_oom=true",
    )
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_engine.json")
    parser.add_argument("--plain-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_worker:
        plain_torchrun(args.plain_worker)
        return 0

    # One intra-op thread per rank, as torchrun sets (and as ups sets for 2 local ranks): the
    # 1-rank runs too, so that scaling compares ranks, not thread pools.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    log.write_text("")
    began, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ups-bench-") as tmp:
        folder = Path(tmp)
        probe = {"warmup": args.warmup, "steps": args.steps, "segment": args.segment}
        timed = write_config(
            folder,
            "timed",
            max_steps=args.warmup + args.steps,
            probe=probe,
            overrides=args.override,
        )
        print(f"throughput, 2 ranks: steps {args.warmup + 1}..{args.warmup + args.steps} timed")
        two = alternate(args.repeats, lambda side: throughput_run(side, timed, 2, log), "2 ranks")
        print("throughput, 1 rank")
        one = alternate(
            args.scaling_repeats, lambda side: throughput_run(side, timed, 1, log), "1 rank"
        )
        first = write_config(
            folder,
            "first",
            max_steps=3,
            probe={"warmup": 0, "steps": 0},
            overrides=args.override,
        )
        print("time to first step: ups train --nproc 2 vs torchrun --nproc-per-node 2")
        starts = alternate(
            args.first_step_repeats, lambda side: first_step_run(side, first, log), "first step"
        )

    ratio = operator.truediv
    engine_1 = statistics.median(r["samples_per_s"] for r in one["engine"])
    engine_2 = statistics.median(r["samples_per_s"] for r in two["engine"])
    result = {
        "command": "nox -s bench",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "backend": "gloo",
            "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        },
        "source": source_state(),
        "overrides": args.override,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plain_worker")},
        "throughput_2_ranks": {
            "steps_per_s": compare(two, "steps_per_s", ratio),
            "window_steps_per_s": compare(two, "window_steps_per_s", ratio),
            "samples_per_s": compare(two, "samples_per_s", ratio),
            "target_ratio": 0.98,
        },
        "throughput_1_rank": {"steps_per_s": compare(one, "steps_per_s", ratio)},
        "first_step": {
            "first_step_s": compare(starts, "first_step_s", operator.sub),
            "exit_s": compare(starts, "exit_s", operator.sub),
            "target_gap_s": 1.0,
        },
        "scaling_engine": {
            "samples_per_s": {"1": engine_1, "2": engine_2},
            "speedup": engine_2 / engine_1,
            "efficiency": engine_2 / engine_1 / 2,
        },
        "wall_s": time.perf_counter() - began,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written: {args.out} (the ranks' logs: {log})")
    return 0


def table(r: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    two, one = r["throughput_2_ranks"], r["throughput_1_rank"]["steps_per_s"]
    first, scaling = r["first_step"], r["scaling_engine"]

    def ratio(c: dict[str, Any]) -> str:
        return f"{c['median']:.3f} [{c['min']:.3f}, {c['max']:.3f}]"

    def gap(c: dict[str, Any]) -> str:
        return f"{c['median']:+.2f} s [{c['min']:+.2f}, {c['max']:+.2f}]"

    rows = [
        ("measure", "engine", "hand-written", "engine vs hand-written (median [min, max])"),
        ("---", "---:", "---:", "---"),
        (
            "steps/s, 2 ranks",
            f"{two['steps_per_s']['engine']:.1f}",
            f"{two['steps_per_s']['plain']:.1f}",
            f"ratio {ratio(two['steps_per_s'])}; target >= {two['target_ratio']}",
        ),
        (
            "steps/s, 2 ranks, whole window",
            f"{two['window_steps_per_s']['engine']:.1f}",
            f"{two['window_steps_per_s']['plain']:.1f}",
            f"ratio {ratio(two['window_steps_per_s'])}",
        ),
        (
            "samples/s, 2 ranks",
            f"{two['samples_per_s']['engine']:.0f}",
            f"{two['samples_per_s']['plain']:.0f}",
            f"ratio {ratio(two['samples_per_s'])}",
        ),
        (
            "steps/s, 1 rank",
            f"{one['engine']:.1f}",
            f"{one['plain']:.1f}",
            f"ratio {ratio(one)}",
        ),
        (
            "launch to first step done",
            f"{first['first_step_s']['engine']:.2f} s",
            f"{first['first_step_s']['plain']:.2f} s",
            f"gap {gap(first['first_step_s'])}; target <= +{first['target_gap_s']:.0f} s",
        ),
        (
            "launch to exit (3 steps)",
            f"{first['exit_s']['engine']:.2f} s",
            f"{first['exit_s']['plain']:.2f} s",
            f"gap {gap(first['exit_s'])}",
        ),
        (
            "engine samples/s, 1 -> 2 ranks",
            f"{scaling['samples_per_s']['1']:.0f} -> {scaling['samples_per_s']['2']:.0f}",
            "",
            f"speedup {scaling['speedup']:.2f}, efficiency {scaling['efficiency']:.2f}",
        ),
    ]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


if __name__ == "__main__":
    sys.exit(main())
