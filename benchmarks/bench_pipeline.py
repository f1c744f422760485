"""Benchmark the engine's training-step contract and its data pipeline, on local CPU ranks (gloo).

Three measurements, each against a baseline taken in the same run, all timed as
``bench_engine.py`` times them (its ``Probe``, an optimizer step post-hook:
``time.perf_counter`` behind a barrier every ``segment`` steps after ``warmup``; a run's rate
is its median segment). The first two run the engine as ``ups.core.train`` starts it
(``ups.core.launch._processes.run_processes(train_here, config)``, the probe registered by the model
factory):

custom step
    The bundled example (``examples/pde_multitask``, 2 ranks, batch 32 per rank) trained with
    (a) the built-in step on the example's ``(inputs, targets, task)`` tuples, the baseline, and
    (b) a :class:`ups.core.Step` subclass (:class:`DictStep`) doing the same maths on dict
    batches (:class:`DictSamples` wraps the example's dataset: ``{"x", "y", "task"}``):
    ``forward`` is ``model(batch["x"])``, ``loss`` the per-sample MSE. (c) The built-in step on
    the same dict batches (``step.options: {inputs: x, target: y, task: task}``) tells the
    dict batches' cost from the subclass's. Rounds alternate the order (a b c, c b a, ...);
    ratios to (a) are taken per round, then their median, min and max. Target: (b)/(a) >= 0.98.
loader-bound data
    One rank training a tiny MLP (256 -> 32 -> 1) on a map-style dataset that reads each sample
    from an HDF5 file (h5py, opened lazily in each process that reads) and transforms it on the
    CPU for a few milliseconds (a random periodic shift, then ``--transform-iters`` rounds of a
    spectral low-pass filter and a pointwise nonlinearity on a 64 x 64 field, NumPy, one thread;
    then 4 x 4 average pooling to 256 features). ``data.loader.num_workers: 2`` with
    ``persistent_workers: true`` against ``num_workers: 0``; rounds alternate the order.
    Target: samples/s with workers / without >= 1.6 (on 2 cores).
the engine's own time per step
    In this process, no DDP, microseconds per step: the engine (``train_in_place``, one
    process) against a hand-written loop (``DataLoader``, forward, MSE, ``zero_grad``,
    backward, ``AdamW`` step) of the same tiny MLP (32 -> 64 -> 1) on in-memory samples, batch
    32; the probe registered by this process around each run, and beside it a clock of the
    process's CPU time (what each side spent, whatever else the machine ran). Rounds alternate
    the order; per round, the engine's microseconds minus the loop's (what the engine itself
    costs a step), wall and CPU, and their ratio.

Every rank (and so the 0-worker side's transform) uses one intra-op thread
(``OMP_NUM_THREADS=1``, as torchrun sets it); loader workers use one thread each (torch sets it).

Usage: ``python benchmarks/bench_pipeline.py [--only step|loader|overhead] [--repeats N]
[--steps N] [--loader-repeats N] [--loader-steps N] [--overhead-repeats N] [--overhead-steps N]
[--out FILE]`` (``nox -s bench_pipeline`` runs it).
Prints a Markdown table and writes a JSON file (default ``.nox-reports/bench_pipeline.json``);
the ranks' logs go next to it (``bench_pipeline.log``).

The ranks load this file as a model, data and step file (``file.py:callable``), without this
folder on ``sys.path``: what they use is importable on its own; ``bench_engine.py`` (the probe,
the runs) is loaded by path.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import operator
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import yaml
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ups.core import Step, load_config
from ups.core.config._user_code import load_object
from ups.core.launch._processes import train_in_place

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
ENGINE_BENCH = HERE.parent / "bench_engine.py"
STATS = HERE.parent / "_stats.py"
EXAMPLE = ROOT / "examples" / "pde_multitask.py"

GRID = 64
"""The HDF5 samples' fields are ``GRID x GRID``; pooled 4 x 4 into ``(GRID // 4) ** 2`` features."""


def _module(path: Path, attr: str) -> Any:
    """The module of the file ``path`` as the engine loads a ``file.py:callable`` (once per
    process)."""
    return inspect.getmodule(load_object(f"{path}:{attr}", "benchmark"))


def engine_bench() -> Any:
    """``bench_engine.py``: its probe, config writer and runs."""
    return _module(ENGINE_BENCH, "Probe")


# ---------------------------------------------------------------------------------------------
# Inside the ranks: the custom step and its dict batches


class DictSamples(Dataset[dict[str, torch.Tensor]]):
    """A dataset of ``(x, y, task)`` tuples, as dicts ``{"x", "y", "task"}``."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y, task = self.base[index]
        return {"x": x, "y": y, "task": task}


def dict_dataset(**options: Any) -> DictSamples:
    """The example's dataset (``options`` are its ``data.options``) with dict samples."""
    return DictSamples(load_object(f"{EXAMPLE}:build_dataset", "data.factory")(**options))


class DictStep(Step):
    """The built-in step's maths on dict batches, as a user writes it: ``model(batch["x"])``,
    the MSE per sample; task ids from ``batch["task"]``."""

    task = "task"

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return model(batch["x"])

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        unreduced = nn.functional.mse_loss(outputs, batch["y"], reduction="none")
        return unreduced.mean(dim=1)


# ---------------------------------------------------------------------------------------------
# Inside the ranks (and their loader workers): HDF5 samples with a CPU transform


def _low_pass() -> np.ndarray:
    ky = np.fft.fftfreq(GRID)[:, None]
    kx = np.fft.rfftfreq(GRID)[None, :]
    return np.exp(-20.0 * (kx**2 + ky**2)).astype(np.float32)


LOW_PASS = _low_pass()


def transform(field: np.ndarray, iters: int) -> np.ndarray:
    """``iters`` rounds of a spectral low-pass filter and ``tanh(u + u^2 / 10)``, then 4 x 4
    average pooling: deterministic NumPy work, one thread, about 75 us a round here."""
    u = field
    for _ in range(iters):
        u = np.fft.irfft2(np.fft.rfft2(u) * LOW_PASS, s=u.shape)
        u = np.tanh(u + 0.1 * u * u)
    pooled = u.reshape(GRID // 4, 4, GRID // 4, 4).mean(axis=(1, 3))
    return pooled.reshape(-1).astype(np.float32)


class H5Fields(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples ``(features, target)`` read from the HDF5 file ``path`` (datasets ``u``:
    ``[n, GRID, GRID]`` float32, one chunk per sample, and ``y``: ``[n, 1]``), then shifted at
    random (the engine seeds it per batch) and :func:`transform`-ed. The file is opened on the
    first read in each process (a loader worker opens its own) and never pickled."""

    def __init__(self, path: str, iters: int) -> None:
        self.path, self.iters = path, iters
        with h5py.File(path, "r") as file:
            self.length = len(file["u"])
        self._file: h5py.File | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": -1}

    def _data(self) -> h5py.File:
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._file

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        file = self._data()
        field, target = file["u"][index], file["y"][index]
        shifted = np.roll(field, tuple(np.random.randint(GRID, size=2)), axis=(0, 1))
        return torch.from_numpy(transform(shifted, self.iters)), torch.from_numpy(target)


def h5_dataset(path: str, iters: int) -> H5Fields:
    return H5Fields(path, iters)


def tiny_model(
    probe: dict[str, Any], features: int = (GRID // 4) ** 2, width: int = 32
) -> nn.Module:
    """A tiny MLP, with ``bench_engine.py``'s probe on every optimizer of this process."""
    register_optimizer_step_post_hook(engine_bench().Probe(**probe))
    return nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, 1))


def write_h5(path: Path, samples: int, seed: int = 0) -> None:
    """``samples`` random smooth fields and a target of each (its mean square)."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((samples, GRID, GRID)).astype(np.float32)
    fields = np.fft.irfft2(np.fft.rfft2(noise) * LOW_PASS, s=(GRID, GRID)).astype(np.float32)
    fields /= fields.std(axis=(1, 2), keepdims=True)
    with h5py.File(path, "w") as file:
        file.create_dataset("u", data=fields, chunks=(1, GRID, GRID))
        file.create_dataset("y", data=(fields**2).mean(axis=(1, 2))[:, None])


# ---------------------------------------------------------------------------------------------
# In this process: the engine's own time per step, against a hand-written loop


def mlp(features: int = 32, width: int = 64) -> nn.Module:
    """The overhead benchmark's tiny MLP, the same weights on both sides."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, 1))


def vectors(samples: int = 4096, features: int = 32) -> TensorDataset:
    """In-memory samples: ``features`` random inputs, their sum the target."""
    x = torch.randn(samples, features, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def plain_loop(steps: int, batch: int) -> None:
    """The hand-written loop: what the engine does for :func:`overhead_config`, and nothing
    else."""
    model = mlp()
    data = DataLoader(
        vectors(), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)
    while True:
        for inputs, targets in data:
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            steps -= 1
            if not steps:
                return


def one_process_config(
    folder: Path, name: str, model: dict[str, Any], data: dict[str, Any], steps: int, batch: int
) -> Path:
    """Write ``folder/<name>.yaml``: one process training ``model`` on ``data`` for ``steps``
    steps of ``batch`` (AdamW, MSE, torch's sampler, no checkpoint but the last), as both of
    this file's comparisons run the engine; return its path."""
    config = {
        "run": {"name": name, "seed": 0, "output_dir": str(folder / "runs"), "log_every": 10},
        "model": model,
        "data": data,
        "training": {
            "epochs": 10**6,
            "max_steps": steps,
            "batch_size": batch,
            "lr": 0.001,
            "optimizer": "adamw",
            "loss": "mse",
        },
        "distributed": {"enabled": "auto", "backend": "gloo", "nproc": 1},
        "sampler": {"name": "torch", "options": {"shuffle": True}},
        "checkpoint": {"name": "simple", "every_steps": None},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def overhead_config(folder: Path, args: argparse.Namespace) -> Path:
    """One process, :func:`mlp` on :func:`vectors`, as :func:`plain_loop` trains it."""
    return one_process_config(
        folder,
        "overhead",
        {"factory": f"{HERE}:mlp"},
        {"factory": f"{HERE}:vectors"},
        args.overhead_warmup + args.overhead_steps,
        args.overhead_batch,
    )


class CpuClock:
    """An optimizer step post-hook that reads this process's CPU time where the probe stamps
    the wall clock (steps ``warmup``, ``warmup + segment``, ... ``warmup + steps``): on a
    shared machine, what the side itself spent, whoever else ran meanwhile."""

    def __init__(self, warmup: int, steps: int, segment: int) -> None:
        self.warmup, self.steps, self.segment = warmup, steps, segment
        self.count = 0
        self.stamps: list[float] = []

    def __call__(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.count += 1
        timed = self.count - self.warmup
        if 0 <= timed <= self.steps and timed % self.segment == 0:
            self.stamps.append(time.process_time())

    def us_per_step(self) -> float:
        """The median segment's CPU microseconds per step."""
        segments = [b - a for a, b in itertools.pairwise(self.stamps)]
        return statistics.median(segments) / self.segment * 1e6


def overhead_run(side: str, config: Path, args: argparse.Namespace, log: Path) -> dict[str, float]:
    """One run of one side in this process, timed by a probe and a :class:`CpuClock`
    registered around it: microseconds per step, the median segment's and the whole window's
    (wall clock), and the median segment's CPU time."""
    engine = engine_bench()
    timing = (args.overhead_warmup, args.overhead_steps, args.overhead_segment)
    probe = engine.Probe(str(config.with_suffix(".probe.json")), *timing)
    clock = CpuClock(*timing)
    handles = [register_optimizer_step_post_hook(hook) for hook in (probe, clock)]
    try:
        with engine.stderr_to(log):
            if side == "engine":
                train_in_place(load_config(config))
            else:
                plain_loop(args.overhead_warmup + args.overhead_steps, args.overhead_batch)
    finally:
        for handle in handles:
            handle.remove()
    record = probe.record
    return {
        "us_per_step": statistics.median(record["segments"]) / record["segment"] * 1e6,
        "window_us_per_step": record["seconds"] / record["steps"] * 1e6,
        "cpu_us_per_step": clock.us_per_step(),
    }


# ---------------------------------------------------------------------------------------------
# The driver

STEP_SIDES = ("builtin", "custom", "builtin_dict")
LOADER_SIDES = ("workers_0", "workers_n")
OVERHEAD_SIDES = ("engine", "plain")


def step_configs(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The example's config as ``bench_engine.py`` writes it, for each side of the step
    benchmark."""
    engine = engine_bench()
    probe = {"warmup": args.warmup, "steps": args.steps, "segment": args.segment}
    paths = {}
    for side in STEP_SIDES:
        path = engine.write_config(
            folder, side, max_steps=args.warmup + args.steps, probe=probe, overrides=[]
        )
        config = yaml.safe_load(path.read_text())
        if side != "builtin":
            config["data"]["factory"] = f"{HERE}:dict_dataset"
        if side == "custom":
            config["step"] = {"factory": f"{HERE}:DictStep"}
        if side == "builtin_dict":
            config["step"] = {"options": {"inputs": "x", "target": "y", "task": "task"}}
        path.write_text(yaml.safe_dump(config))
        paths[side] = path
    return paths


def loader_configs(folder: Path, args: argparse.Namespace, h5: Path) -> dict[str, Path]:
    """One rank, the tiny model, the HDF5 data; ``num_workers`` 0 and ``args.workers``."""
    probe = {
        "out": "",
        "warmup": args.loader_warmup,
        "steps": args.loader_steps,
        "segment": args.loader_segment,
    }
    paths = {}
    for side in LOADER_SIDES:
        loader: dict[str, Any] = {"num_workers": 0}
        if side == "workers_n":
            loader = {"num_workers": args.workers, "persistent_workers": True}
            if args.mp_context != "default":
                loader["multiprocessing_context"] = args.mp_context
        path = one_process_config(
            folder,
            side,
            {
                "factory": f"{HERE}:tiny_model",
                "options": {"probe": {**probe, "out": str(folder / f"{side}.probe.json")}},
            },
            {
                "factory": f"{HERE}:h5_dataset",
                "options": {"path": str(h5), "iters": args.transform_iters},
                "loader": loader,
            },
            args.loader_warmup + args.loader_steps,
            args.batch,
        )
        paths[side] = path
    return paths


def compare(
    runs: dict[str, list[dict[str, float]]],
    key: str,
    side: str,
    baseline: str,
    how: Callable[[float, float], float] = operator.truediv,
) -> dict[str, Any]:
    """Per round, ``how(side's key, baseline's)`` (by default their ratio): median, min, max."""
    values = [how(s[key], b[key]) for s, b in zip(runs[side], runs[baseline], strict=True)]
    return {"per_round": values, **_module(STATS, "summary").summary(values)}


def medians(runs: dict[str, list[dict[str, float]]], key: str) -> dict[str, float]:
    return {side: statistics.median(r[key] for r in rs) for side, rs in runs.items()}


def data_costs(h5: Path, iters: int, samples: int = 200) -> dict[str, float]:
    """Milliseconds per sample, in this process (one thread): the HDF5 read, the transform,
    and the dataset's whole ``__getitem__``."""
    dataset = H5Fields(str(h5), iters)
    file = dataset._data()
    indices = np.random.default_rng(1).integers(len(dataset), size=samples)
    field = file["u"][0]
    timings = {}
    for name, fn in {
        "read_ms": lambda i: (file["u"][i], file["y"][i]),
        "transform_ms": lambda i: transform(field, iters),
        "getitem_ms": lambda i: dataset[i],
    }.items():
        rounds = []
        for _ in range(3):
            began = time.perf_counter()
            for i in indices:
                fn(int(i))
            rounds.append((time.perf_counter() - began) / samples * 1e3)
        timings[name] = min(rounds)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", choices=("step", "loader", "overhead"), help="run one benchmark only"
    )
    parser.add_argument("--repeats", type=int, default=10, help="rounds of the step benchmark")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per step run")
    parser.add_argument("--segment", type=int, default=100, help="steps per timed segment")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timed window")
    parser.add_argument("--loader-repeats", type=int, default=5, help="rounds of the loader one")
    parser.add_argument("--loader-steps", type=int, default=200, help="timed steps per run")
    parser.add_argument("--loader-segment", type=int, default=25)
    parser.add_argument("--loader-warmup", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2, help="data.loader.num_workers")
    parser.add_argument(
        "--mp-context",
        choices=("fork", "spawn", "forkserver", "default"),
        default="fork",
        help="data.loader.multiprocessing_context of the workers (default: not set)",
    )
    parser.add_argument("--batch", type=int, default=16, help="batch size of the loader one")
    parser.add_argument("--overhead-repeats", type=int, default=7, help="rounds of the overhead")
    parser.add_argument("--overhead-steps", type=int, default=2000, help="timed steps per run")
    parser.add_argument("--overhead-segment", type=int, default=200)
    parser.add_argument("--overhead-warmup", type=int, default=50)
    parser.add_argument("--overhead-batch", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2048, help="samples in the HDF5 file")
    parser.add_argument("--transform-iters", type=int, default=48, help="rounds per sample")
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_pipeline.json")
    args = parser.parse_args(argv)

    # One intra-op thread per rank, as torchrun sets, and as bench_engine.py runs.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    engine = engine_bench()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    log.write_text("")
    began, load_before = time.perf_counter(), os.getloadavg()
    result: dict[str, Any] = {
        "command": "nox -s bench_pipeline",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "h5py": h5py.__version__,
            "numpy": np.__version__,
            "backend": "gloo",
        },
        "source": _module(STATS, "source_state").source_state(
            "packages/ups-dist-core/src", "benchmarks"
        ),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory(prefix="ups-bench-pipeline-") as tmp:
        folder = Path(tmp)
        if args.only in (None, "step"):
            configs = step_configs(folder, args)
            print(
                f"custom step, 2 ranks: steps {args.warmup + 1}..{args.warmup + args.steps} timed"
            )
            runs = engine.alternate(
                args.repeats,
                lambda side: engine.throughput_run("engine", configs[side], 2, log),
                "step",
                STEP_SIDES,
            )
            result["custom_step"] = {
                "steps_per_s": medians(runs, "steps_per_s"),
                "window_steps_per_s": medians(runs, "window_steps_per_s"),
                "samples_per_s": medians(runs, "samples_per_s"),
                "custom_vs_builtin": compare(runs, "steps_per_s", "custom", "builtin"),
                "custom_vs_builtin_window": compare(
                    runs, "window_steps_per_s", "custom", "builtin"
                ),
                "builtin_dict_vs_builtin": compare(runs, "steps_per_s", "builtin_dict", "builtin"),
                "custom_vs_builtin_dict": compare(runs, "steps_per_s", "custom", "builtin_dict"),
                "target_ratio": 0.98,
                "runs": runs,
            }
        if args.only in (None, "loader"):
            h5 = folder / "fields.h5"
            write_h5(h5, args.samples)
            costs = data_costs(h5, args.transform_iters)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in costs.items())
            print(f"loader-bound data, 1 rank: per sample, one thread: {shown}")
            configs = loader_configs(folder, args, h5)
            runs = engine.alternate(
                args.loader_repeats,
                lambda side: engine.throughput_run("engine", configs[side], 1, log),
                "loader",
                LOADER_SIDES,
            )
            result["loader"] = {
                "per_sample_ms": costs,
                "samples_per_s": medians(runs, "samples_per_s"),
                "window_samples_per_s": {
                    side: statistics.median(r["window_steps_per_s"] * args.batch for r in rs)
                    for side, rs in runs.items()
                },
                "workers_vs_none": compare(runs, "samples_per_s", "workers_n", "workers_0"),
                "workers_vs_none_window": compare(
                    runs, "window_steps_per_s", "workers_n", "workers_0"
                ),
                "target_ratio": 1.6,
                "runs": runs,
            }
        if args.only in (None, "overhead"):
            config = overhead_config(folder, args)
            print(f"the engine's own time per step, 1 process: {args.overhead_steps} steps timed")
            runs = engine.alternate(
                args.overhead_repeats,
                lambda side: overhead_run(side, config, args, log),
                "overhead",
                OVERHEAD_SIDES,
            )
            result["overhead"] = {
                "us_per_step": medians(runs, "us_per_step"),
                "window_us_per_step": medians(runs, "window_us_per_step"),
                "engine_minus_plain_us": compare(
                    runs, "us_per_step", "engine", "plain", operator.sub
                ),
                "engine_vs_plain": compare(runs, "us_per_step", "engine", "plain"),
                "cpu_us_per_step": medians(runs, "cpu_us_per_step"),
                "cpu_engine_minus_plain_us": compare(
                    runs, "cpu_us_per_step", "engine", "plain", operator.sub
                ),
                "runs": runs,
            }
    result["machine"]["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    result["wall_s"] = time.perf_counter() - began
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written: {args.out} (the ranks' logs: {log})")
    return 0


def table(r: dict[str, Any]) -> str:
    """The results as a Markdown table."""

    def spread(c: dict[str, Any]) -> str:
        return f"{c['median']:.3f} [{c['min']:.3f}, {c['max']:.3f}]"

    rows = [
        ("measure", "value", "baseline", "ratio (median [min, max] of the rounds)"),
        ("---", "---:", "---:", "---"),
    ]
    if "custom_step" in r:
        s = r["custom_step"]
        steps, window = s["steps_per_s"], s["window_steps_per_s"]
        target = s["target_ratio"]
        rows += [
            (
                "steps/s, 2 ranks: custom `Step` on dicts vs built-in on tuples",
                f"{steps['custom']:.1f}",
                f"{steps['builtin']:.1f}",
                f"{spread(s['custom_vs_builtin'])}; target >= {target}",
            ),
            (
                "the same, whole window",
                f"{window['custom']:.1f}",
                f"{window['builtin']:.1f}",
                spread(s["custom_vs_builtin_window"]),
            ),
            (
                "steps/s, 2 ranks: built-in on dicts vs built-in on tuples",
                f"{steps['builtin_dict']:.1f}",
                f"{steps['builtin']:.1f}",
                spread(s["builtin_dict_vs_builtin"]),
            ),
            (
                "steps/s, 2 ranks: custom `Step` vs built-in, both on dicts",
                f"{steps['custom']:.1f}",
                f"{steps['builtin_dict']:.1f}",
                spread(s["custom_vs_builtin_dict"]),
            ),
        ]
    if "loader" in r:
        d = r["loader"]
        workers = r["settings"]["workers"]
        costs = d["per_sample_ms"]
        rows += [
            (
                f"samples/s, 1 rank, HDF5 + transform: {workers} workers vs 0",
                f"{d['samples_per_s']['workers_n']:.0f}",
                f"{d['samples_per_s']['workers_0']:.0f}",
                f"{spread(d['workers_vs_none'])}; target >= {d['target_ratio']}",
            ),
            (
                "the same, whole window",
                f"{d['window_samples_per_s']['workers_n']:.0f}",
                f"{d['window_samples_per_s']['workers_0']:.0f}",
                spread(d["workers_vs_none_window"]),
            ),
            (
                "per sample, one thread (ms): HDF5 read, transform, `__getitem__`",
                f"{costs['read_ms']:.3f}, {costs['transform_ms']:.3f}, {costs['getitem_ms']:.3f}",
                "",
                f"0-worker ceiling {1e3 / costs['getitem_ms']:.0f} samples/s",
            ),
        ]
    if "overhead" in r:
        o = r["overhead"]
        us, own = o["us_per_step"], o["engine_minus_plain_us"]
        batch = r["settings"]["overhead_batch"]
        rows.append(
            (
                f"us/step, 1 process, tiny MLP, batch {batch}: engine vs hand-written loop",
                f"{us['engine']:.0f}",
                f"{us['plain']:.0f}",
                f"{spread(o['engine_vs_plain'])}; the engine's own: "
                f"{own['median']:.0f} us [{own['min']:.0f}, {own['max']:.0f}]",
            )
        )
        cpu, cpu_own = o["cpu_us_per_step"], o["cpu_engine_minus_plain_us"]
        rows.append(
            (
                "the same, CPU time of the process",
                f"{cpu['engine']:.0f}",
                f"{cpu['plain']:.0f}",
                f"the engine's own: {cpu_own['median']:.0f} us "
                f"[{cpu_own['min']:.0f}, {cpu_own['max']:.0f}]",
            )
        )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


if __name__ == "__main__":
    sys.exit(main())
