"""Benchmark the samplers of ups-samplers against torch's ``DistributedSampler``.

One epoch of indices for one rank (rank 0 of ``--world-size``, default 8) over ``--size``
samples (default 10^8): build the sampler, ``set_epoch(1)``, and consume every index it yields
(``collections.deque(iter(sampler), maxlen=0)``). Four samplers:

torch
    ``torch.utils.data.DistributedSampler`` over an object with ``__len__`` only: the baseline.
tensor
    ``TensorDistributedSampler``, its drop-in (same arguments, same indices).
tensor-keyed
    ``TensorDistributedSampler(permutation="keyed")``: another order, of which the rank draws
    only its share.
multitask-temperature, multitask-proportional
    ``MultiTaskDistributedSampler`` over 11 tasks of unequal sizes adding up to ``--size``
    (weights 1, 2, 3, 5, ..., 144, a spread of two orders of magnitude, a few large tasks and
    many small ones, as in suites of PDE datasets), mixed by temperature (``temperature=2``,
    the default) and in proportion to size.

Each measurement runs in a fresh Python process (this file with ``--worker``), with one
intra-op thread (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``), and reports

- time: ``time.perf_counter`` around build + ``set_epoch`` + iteration;
- memory: the peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) minus the RSS just before the
  sampler is built (after the imports). On Linux the peak is reset there first (``5`` into
  ``/proc/self/clear_refs``), so that the imports' own peak cannot hide the sampler's. The
  absolute peak is reported too.

Rounds alternate the order (torch, tensor, multitask..., then the reverse, ...). Reported per
sampler: the median and [min, max] over the rounds; per ratio: the median, min and max of the
per-round ratios, against its target:

- tensor (and tensor-keyed) / torch, time <= 0.2; and peak memory over the baseline <= 0.25;
- multitask (each mixing) / tensor, time <= 1.1 (and multitask / torch, for reference).

Usage: ``python benchmarks/bench_samplers.py [--size N] [--world-size W] [--repeats N]
[--out FILE]`` (``nox -s bench_samplers`` runs it). Prints a Markdown table and writes a JSON
file (default ``.nox-reports/bench_samplers.json``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _stats import source_state, summary

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

SAMPLERS = ("torch", "tensor", "tensor-keyed", "multitask-temperature", "multitask-proportional")
LABELS = {
    "torch": "torch DistributedSampler",
    "tensor": "TensorDistributedSampler",
    "tensor-keyed": "TensorDistributedSampler, permutation keyed",
    "multitask-temperature": "MultiTaskDistributedSampler, temperature",
    "multitask-proportional": "MultiTaskDistributedSampler, proportional",
}
TASK_WEIGHTS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144)
"""The 11 tasks' relative sizes."""
SEED = 0
EPOCH = 1
RANK = 0
TEMPERATURE = 2.0


def task_sizes(total: int, weights: tuple[int, ...] = TASK_WEIGHTS) -> list[int]:
    """``total`` split in proportion to ``weights``, largest remainder: they add up to it."""
    whole = sum(weights)
    sizes = [total * w // whole for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda t: (-(total * weights[t] % whole), t))
    for t in by_remainder[: total - sum(sizes)]:
        sizes[t] += 1
    return sizes


# ---------------------------------------------------------------------------------------------
# Inside a worker: one measurement


class Length:
    """A dataset as torch's sampler sees it: a length and nothing else."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def rss_kib() -> int:
    """This process's resident set size now, in KiB (Linux: ``/proc/self/statm``)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:  # not Linux: the peak so far is the best we have
        return peak_kib()
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_kib() -> int:
    """The peak RSS so far, in KiB (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def reset_peak() -> bool:
    """Set the peak RSS to the RSS now, where the system allows it (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def worker(kind: str, size: int, world_size: int) -> dict[str, Any]:
    """Build ``kind``'s sampler for rank 0, ``set_epoch(1)``, consume its indices; report."""
    import torch
    from torch.utils.data import Dataset, DistributedSampler

    from ups.samplers import MultiTaskDistributedSampler, TensorDistributedSampler

    torch.set_num_threads(1)
    sizes = task_sizes(size)
    dataset = Length(size)
    gc.collect()
    reset = reset_peak()
    before = rss_kib()
    started = time.perf_counter()
    sampler: Any
    if kind == "torch":
        # Only len() of the dataset is used; torch's annotation asks for a Dataset.
        fake: Dataset[int] = dataset  # type: ignore[assignment]
        sampler = DistributedSampler(fake, num_replicas=world_size, rank=RANK, seed=SEED)
    elif kind in ("tensor", "tensor-keyed"):
        sampler = TensorDistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=RANK,
            seed=SEED,
            permutation="keyed" if kind == "tensor-keyed" else "torch",
        )
    else:
        mixing = kind.removeprefix("multitask-")
        assert mixing in ("temperature", "proportional"), kind
        sampler = MultiTaskDistributedSampler(
            sizes,
            num_replicas=world_size,
            rank=RANK,
            mixing=mixing,  # type: ignore[arg-type]
            temperature=TEMPERATURE,
            seed=SEED,
        )
    sampler.set_epoch(EPOCH)
    built = time.perf_counter()
    indices = iter(sampler)
    drawn = time.perf_counter()
    collections.deque(indices, maxlen=0)
    ended = time.perf_counter()
    peak = peak_kib()
    return {
        "sampler": kind,
        "seconds": ended - started,
        "build_s": built - started,
        "iter_s": drawn - built,
        "consume_s": ended - drawn,
        "peak_over_baseline_mib": (peak - before) / 1024,
        "peak_mib": peak / 1024,
        "baseline_mib": before / 1024,
        "peak_reset": reset,
        "length": len(sampler),
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------
# The driver (no torch here: it would only add to the workers' start)


def measure(kind: str, size: int, world_size: int) -> dict[str, Any]:
    """One measurement of ``kind`` in a fresh process with one intra-op thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, str(HERE), "--worker", kind]
    command += ["--size", str(size), "--world-size", str(world_size)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    if done.stderr:
        sys.stderr.write(done.stderr)
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return record


def ratio(
    runs: dict[str, list[dict[str, Any]]], ours: str, base: str, key: str, target: float | None
) -> dict[str, Any]:
    """Per round, ``ours[key] / base[key]``; its median, min and max, against ``target``."""
    values = [o[key] / b[key] for o, b in zip(runs[ours], runs[base], strict=True)]
    result: dict[str, Any] = {"ours": ours, "base": base, "key": key, "per_round": values}
    result.update(summary(values))
    if target is not None:
        result.update(target=target, met=result["median"] <= target)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000_000, help="samples in the dataset")
    parser.add_argument("--world-size", type=int, default=8, help="ranks (rank 0 is measured)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every sampler")
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_samplers.json")
    parser.add_argument("--worker", choices=SAMPLERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size < len(TASK_WEIGHTS) or args.world_size < 1 or args.repeats < 1:
        parser.error("--size must be at least 11 and --world-size, --repeats at least 1")
    if args.worker:
        print(json.dumps(worker(args.worker, args.size, args.world_size)))
        return 0

    args.out.parent.mkdir(parents=True, exist_ok=True)
    sizes = task_sizes(args.size)
    print(
        f"one epoch of rank 0 of {args.world_size}, {args.size:,} samples; "
        f"{args.repeats} rounds; multitask sizes {sizes}",
        flush=True,
    )
    began, load_before = time.perf_counter(), os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SAMPLERS}
    for i in range(args.repeats):
        for kind in SAMPLERS if i % 2 == 0 else SAMPLERS[::-1]:
            run = measure(kind, args.size, args.world_size)
            runs[kind].append(run)
            print(
                f"  round {i + 1}/{args.repeats} {kind:22}: {run['seconds']:.3f} s, "
                f"peak +{run['peak_over_baseline_mib']:.1f} MiB "
                f"(absolute {run['peak_mib']:.1f} MiB)",
                flush=True,
            )
    lengths = {kind: {r["length"] for r in runs[kind]} for kind in SAMPLERS}
    if len(set().union(*lengths.values())) != 1:
        print(f"warning: the samplers yielded different numbers of indices: {lengths}")
    samplers = {
        kind: {
            "label": LABELS[kind],
            "seconds": summary([r["seconds"] for r in runs[kind]]),
            "peak_over_baseline_mib": summary([r["peak_over_baseline_mib"] for r in runs[kind]]),
            "peak_mib": summary([r["peak_mib"] for r in runs[kind]]),
            "baseline_mib": summary([r["baseline_mib"] for r in runs[kind]]),
            "length": sorted(lengths[kind]),
        }
        for kind in SAMPLERS
    }
    time_key, memory_key = "seconds", "peak_over_baseline_mib"
    ratios = {
        "tensor_vs_torch_time": ratio(runs, "tensor", "torch", time_key, 0.2),
        "tensor_vs_torch_memory": ratio(runs, "tensor", "torch", memory_key, 0.25),
        "tensor_keyed_vs_torch_time": ratio(runs, "tensor-keyed", "torch", time_key, 0.2),
        "tensor_keyed_vs_torch_memory": ratio(runs, "tensor-keyed", "torch", memory_key, 0.25),
        "multitask_temperature_vs_tensor_time": ratio(
            runs, "multitask-temperature", "tensor", time_key, 1.1
        ),
        "multitask_proportional_vs_tensor_time": ratio(
            runs, "multitask-proportional", "tensor", time_key, 1.1
        ),
        "multitask_temperature_vs_torch_time": ratio(
            runs, "multitask-temperature", "torch", time_key, None
        ),
        "multitask_temperature_vs_torch_memory": ratio(
            runs, "multitask-temperature", "torch", memory_key, None
        ),
        "multitask_proportional_vs_torch_time": ratio(
            runs, "multitask-proportional", "torch", time_key, None
        ),
        "multitask_proportional_vs_torch_memory": ratio(
            runs, "multitask-proportional", "torch", memory_key, None
        ),
    }
    result = {
        "command": "nox -s bench_samplers",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "threads": "1 (OMP_NUM_THREADS=1, torch.set_num_threads(1))",
            "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        },
        "source": source_state("packages/ups-samplers/src", "packages/ups-dist-core/src"),
        "settings": {
            "size": args.size,
            "world_size": args.world_size,
            "rank": RANK,
            "epoch": EPOCH,
            "seed": SEED,
            "repeats": args.repeats,
            "task_sizes": sizes,
            "temperature": TEMPERATURE,
        },
        "samplers": samplers,
        "ratios": ratios,
        "runs": runs,
        "wall_s": time.perf_counter() - began,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written: {args.out}")
    return 0


def table(r: dict[str, Any]) -> str:
    """The results as Markdown: a table of the samplers, then one of the ratios against their
    targets."""
    s, settings = r["samplers"], r["settings"]

    def spread(c: dict[str, float], digits: int) -> str:
        return f"{c['median']:.{digits}f} [{c['min']:.{digits}f}, {c['max']:.{digits}f}]"

    def vs_torch(kind: str, key: str) -> str:
        if kind == "torch":
            return "1"
        return spread(r["ratios"][f"{kind.replace('-', '_')}_vs_torch_{key}"], 3)

    def markdown(rows: list[tuple[str, ...]]) -> str:
        return "\n".join("| " + " | ".join(row) + " |" for row in rows)

    samplers: list[tuple[str, ...]] = [
        (
            "sampler",
            "time, s",
            "peak over baseline, MiB",
            "peak RSS, MiB",
            "time vs torch",
            "memory vs torch",
        ),
        ("---", "---:", "---:", "---:", "---:", "---:"),
    ]
    for kind, c in s.items():
        samplers.append(
            (
                c["label"],
                spread(c["seconds"], 3),
                spread(c["peak_over_baseline_mib"], 1),
                spread(c["peak_mib"], 1),
                vs_torch(kind, "time"),
                vs_torch(kind, "memory"),
            )
        )
    targets: list[tuple[str, ...]] = [
        ("ratio", "median [min, max] of the rounds", "target", "met"),
        ("---", "---:", "---", "---"),
    ]
    for label, key in (
        ("TensorDistributedSampler / torch, time", "tensor_vs_torch_time"),
        ("TensorDistributedSampler / torch, peak memory", "tensor_vs_torch_memory"),
        ("TensorDistributedSampler keyed / torch, time", "tensor_keyed_vs_torch_time"),
        ("TensorDistributedSampler keyed / torch, peak memory", "tensor_keyed_vs_torch_memory"),
        (
            "multitask temperature / TensorDistributedSampler, time",
            "multitask_temperature_vs_tensor_time",
        ),
        (
            "multitask proportional / TensorDistributedSampler, time",
            "multitask_proportional_vs_tensor_time",
        ),
    ):
        c = r["ratios"][key]
        targets.append((label, spread(c, 3), f"<= {c['target']}", "yes" if c["met"] else "no"))
    header = (
        f"One epoch of rank {settings['rank']} of {settings['world_size']} ranks, "
        f"{settings['size']:,} samples, {settings['repeats']} rounds, one thread per process; "
        "median [min, max] over the rounds. Memory: peak RSS over the RSS before the build."
    )
    return f"{header}\n\n{markdown(samplers)}\n\n{markdown(targets)}"


if __name__ == "__main__":
    sys.exit(main())
