"""Benchmark the engine on one CUDA device (``nox -s bench_gpu``; docs/gpu.md).

Two measurements, each against its baseline in the same process, once (one run each):

engine vs loop
    A compute-bound model (``--depth`` blocks of ``Linear(width, width)`` and GELU, between a
    ``Linear(256, width)`` and a ``Linear(width, 256)``; width 4096, depth 8: 135 M
    parameters) trained in bf16 with fused AdamW on batches of 512 random samples (2 loader
    workers, pinned memory), (a) by the engine (``ups.core.train`` of a config, one process)
    and (b) by a hand-written loop: the same model, data, loader options, optimizer, autocast
    and non-blocking copies. A global optimizer step post-hook (the same on both sides) times
    steps ``warmup+1 .. warmup+steps`` with ``torch.cuda.synchronize`` at both ends, so neither
    start-up nor the final checkpoint is timed. Reported: each side's steps/s and their ratio.
async checkpoint stall vs sync
    The model's and optimizer's state after a step, in GPU memory (about 1.6 GB), saved by
    ups-ckpt's ``local`` backend: synchronously (the time ``save`` takes), and with
    ``async_save: true`` (the time ``save`` blocks the caller: the copy of the state into pinned
    host memory; the first background save allocates that memory, later ones reuse it, so a
    second save's stall is the one a run pays at every checkpoint), then the background save's
    time to its commit. Reported: each time, and the stall over the synchronous save.

Usage: ``python benchmarks/bench_gpu.py [--steps N] [--warmup N] [--width N] [--depth N]
[--out FILE]``. Prints a Markdown table and writes JSON (default
``.nox-reports/bench_gpu.json``). Without a CUDA device it exits at once, saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _stats import ROOT, source_state
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, TensorDataset

FEATURES, BATCH, SAMPLES, LR = 256, 512, 512 * 64, 1e-4
LOADER = {"num_workers": 2, "persistent_workers": True, "pin_memory": True}


def build_model(width: int = 4096, depth: int = 8) -> nn.Module:
    """The compute-bound model (seeded: both sides start from the same weights)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(FEATURES, width)]
    for _ in range(depth):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(width, FEATURES))


def build_dataset(n: int = SAMPLES) -> TensorDataset:
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sin())


class Probe:
    """Times optimizer steps ``warmup+1 .. warmup+steps`` of whatever trains in this process
    (a global optimizer step post-hook)."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.count, self.started, self.seconds = 0, 0.0, float("nan")
        self._handle = register_optimizer_step_post_hook(self._step)

    def _step(self, *_: Any) -> None:
        self.count += 1
        if self.count in (self.warmup, self.warmup + self.steps):
            torch.cuda.synchronize()
            now = time.perf_counter()
            if self.count == self.warmup:
                self.started = now
            else:
                self.seconds = now - self.started

    def rate(self) -> float:
        """Steps per second in the timed window."""
        self._handle.remove()
        if self.count < self.warmup + self.steps:
            raise RuntimeError(f"only {self.count} steps taken of {self.warmup + self.steps}")
        return self.steps / self.seconds


def engine(args: argparse.Namespace, folder: Path) -> float:
    """Steps per second of ``ups.core.train`` of the model, one process."""
    from ups.core import train

    here = Path(__file__).resolve()
    config = {
        "run": {"name": "bench", "output_dir": str(folder), "log_every": 50},
        "model": {
            "factory": f"{here}:build_model",
            "options": {"width": args.width, "depth": args.depth},
        },
        "data": {"factory": f"{here}:build_dataset", "loader": LOADER},
        "training": {
            "batch_size": BATCH,
            "lr": LR,
            "optimizer": "adamw",
            "precision": "bf16",
            "max_steps": args.warmup + args.steps,
            "epochs": 1000,
        },
    }
    probe = Probe(args.warmup, args.steps)
    train(config, nproc=1)
    return probe.rate()


def loop(args: argparse.Namespace) -> float:
    """Steps per second of a hand-written loop doing the engine's work."""
    device = torch.device("cuda", 0)
    model = build_model(args.width, args.depth).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    loader = DataLoader(build_dataset(), batch_size=BATCH, shuffle=True, **LOADER)  # type: ignore[arg-type]
    probe = Probe(args.warmup, args.steps)
    while probe.count < args.warmup + args.steps:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if probe.count == args.warmup + args.steps:
                break
    return probe.rate()


def checkpoint_stall(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """Seconds of a synchronous ``local`` save of a state in GPU memory, and of an async one's
    stalls (first and second save) and its time to commit."""
    from ups.ckpt import LocalCheckpointOptions
    from ups.ckpt.plugin import local_backend
    from ups.core import RunContext

    device = torch.device("cuda", 0)
    model = build_model(args.width, args.depth).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    model(torch.randn(8, FEATURES, device=device)).square().mean().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}
    rank_state = {"rng": torch.get_rng_state()}
    ctx = RunContext(device=device)

    def saver(name: str, background: bool) -> Any:
        options = LocalCheckpointOptions(keep_last=1, async_save=background)
        return local_backend(ctx=ctx, directory=folder / name, options=options)

    def timed(checkpointer: Any, step: int) -> tuple[float, float]:
        """When ``save`` started, and how long it blocked."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        checkpointer.save(state, step=step, rank_state=rank_state)
        return start, time.perf_counter() - start

    sync = saver("sync", False)
    timed(sync, 0)  # warm-up: folders made, a first large write done
    found = {"sync_s": timed(sync, 1)[1]}
    background = saver("async", True)
    found["first_stall_s"] = timed(background, 1)[1]
    background.wait()
    start, found["stall_s"] = timed(background, 2)
    background.wait()
    found["commit_s"] = time.perf_counter() - start
    found["stall_vs_sync"] = found["stall_s"] / found["sync_s"]
    found["bytes"] = sum(
        t.numel() * t.element_size()
        for t in [*model.state_dict().values(), *_tensors(optimizer.state_dict())]
    )
    return found


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_gpu.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA device: torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}) sees none; this benchmark "
            "measures the engine on a GPU and needs one",
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch:
        engine_rate = engine(args, Path(scratch))
        loop_rate = loop(args)
        stall = checkpoint_stall(args, Path(scratch))
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "source": source_state("benchmarks", "packages"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "engine_steps_per_s": engine_rate,
        "loop_steps_per_s": loop_rate,
        "engine_vs_loop": engine_rate / loop_rate,
        "checkpoint": stall,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    gb = stall["bytes"] / 1e9
    print(f"{result['device']}, torch {result['torch']}\n")
    print("| measurement | value |\n|---|---|")
    print(f"| engine, steps/s | {engine_rate:.2f} |")
    print(f"| hand-written loop, steps/s | {loop_rate:.2f} |")
    print(f"| engine / loop | {result['engine_vs_loop']:.3f} |")
    print(f"| sync `local` save of {gb:.2f} GB on GPU, s | {stall['sync_s']:.3f} |")
    print(f"| async save, first stall, s | {stall['first_stall_s']:.3f} |")
    print(f"| async save, stall, s | {stall['stall_s']:.3f} |")
    print(f"| async save, to its commit, s | {stall['commit_s']:.3f} |")
    print(f"| async stall / sync save | {stall['stall_vs_sync']:.3f} |")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
