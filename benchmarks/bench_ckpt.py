"""Benchmark ups-ckpt's checkpoint saving against a bare ``torch.save`` of the same state.

The state is a training state as the engine saves it: ``{"model": state_dict, "optimizer":
state_dict, ...}`` of a stack of blocks (``Linear(d, 4d)``, GELU, ``Linear(4d, d)``,
``LayerNorm(d)``; d = 1024, blocks enough for ``--params`` float32 parameters, default 10^8)
and of ``torch.optim.Adam`` after one step (its ``exp_avg`` and ``exp_avg_sq``: three times the
model's bytes in all), plus a few plain values (step, epoch, a small config dict, a loss). The
rank state is ``{"rng": torch.get_rng_state(), "seed": 0}``. Measured, each save into a new
file or folder under ``--dir`` (one filesystem for all):

torch.save
    ``torch.save(state, path)``: the baseline of target 1.
local
    ``LocalCheckpointer.save`` (``keep_last: 1``, synchronous): the safety check of the state,
    the temporary folder, ``state.pt`` and ``rank-0.pt`` written and fsynced with their CRC-32s,
    ``COMMIT`` written and fsynced, the folder renamed and fsynced, ``latest`` replaced, the
    previous (warm-up) checkpoint deleted.
torch.save+fsync
    the same, then ``os.fsync`` of the file: a baseline as durable as our save. Its two parts
    are timed apart.
dump+fsync
    what the ``local`` backend does to write ``state.pt``: ``ups.core.dump`` (torch.save
    without torch's per-record CRC-32, the whole file's CRC-32 taken by zlib as the bytes go
    out) into a new file, flush, ``os.fsync``; the parts timed apart. For the breakdown.
crc32
    ``zlib.crc32`` over every tensor's bytes in memory (no disk): the cost of the checksum.
copy
    ``copy_`` of every tensor into a tensor allocated and written before the timing (no page
    faults): the memory bandwidth floor of a staging copy.
sharded
    ``ShardedCheckpointer.save`` in one process (no process group): the skeleton, the tensors
    through torch DCP, for reference.
async
    ``local`` with ``async_save: true``, nothing in flight before (the warm-up's save was waited
    for): the stall is the time ``save`` blocks the caller (staging copy of the state). A
    run's first background save stages into new memory (reported as ``first_stall_s``); every
    later one copies into the buffers it left (:class:`ups.ckpt.Stager`), so one untimed save
    of the state comes first and the stall measured is a later save's; then
    the training thread runs the compute loop (below) until the background save has
    committed (a helper thread waits for it), and we report the loop's rate during the save
    and the save's duration from the ``save`` call to its commit.
compute
    the compute loop alone for ``--compute-seconds``: ``torch.mm`` of two 512 x 512 float32
    matrices into a preallocated output, repeated, with torch's default intra-op threads.
compute-t1, async-t1
    the same two with one intra-op thread (``torch.set_num_threads(1)`` around them), which
    leaves the writer thread a core of this 2-core machine.

Each round runs in a fresh Python process (this file with ``--worker``) that builds the state,
warms up every measurement once on a tiny state (the checkpointers' folders made, their first
save done, the background writer thread started) and once more with one full-size
``torch.save`` (a process's first large write was seen to take 2-4 times as long as the next,
whatever it was), then measures each kind once at full size, in the round's order; rounds
alternate the order (the list above, then its reverse, ...): the baseline and ``local`` are
always measured one after the other.
Between two measurements, untimed: the files written are deleted and ``os.sync()`` flushes
what is left dirty, so no save pays for another's writeback. Timing is ``time.perf_counter``.

Reported per kind: the median and [min, max] over the rounds of the time and throughput (bytes
written, state and rank state, over the time); per ratio, the median, min and max of the
per-round ratios, against its target:

- target 1: torch.save time / local time >= 0.9 (throughput of a synchronous save at least 0.9x
  a bare torch.save's); the same against torch.save+fsync is given too;
- target 2: async stall / local time <= 0.1 (the training stall of a background save at most
  0.1x a synchronous save of the same state);
- for honesty: the compute loop's rate during a background save over its rate alone, on the
  same machine (2 cores here: the writer thread competes with the loop's threads), and what a
  background save costs the training in all, over the synchronous save's time: the stall plus
  the loop's work lost while the save ran (the window times 1 - rate during / rate alone).

Usage: ``python benchmarks/bench_ckpt.py [--params N] [--repeats N] [--compute-seconds S]
[--dir FOLDER] [--out FILE]`` (``nox -s bench_ckpt`` runs it). Prints a Markdown table and
writes a JSON file (default ``.nox-reports/bench_ckpt.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _stats import source_state, summary

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

KINDS = (
    "torch.save",
    "local",
    "torch.save+fsync",
    "dump+fsync",
    "crc32",
    "copy",
    "sharded",
    "async",
    "compute",
    "compute-t1",
    "async-t1",
)
LABELS = {
    "torch.save": "`torch.save` (baseline)",
    "local": "`local` save, synchronous",
    "torch.save+fsync": "`torch.save` + `os.fsync`",
    "dump+fsync": "`serialize.dump` + `os.fsync` (local's state.pt)",
    "crc32": "`zlib.crc32` of the tensors, in memory",
    "copy": "copy of the tensors into touched memory",
    "sharded": "`sharded` save, synchronous, one process",
    "async": "`local` save, `async_save: true`: stall",
    "compute": "compute loop alone",
    "compute-t1": "compute loop alone, 1 thread",
    "async-t1": "`local` save, `async_save: true`: stall, 1 thread",
}
WIDTH = 1024
"""The blocks' width d."""
MATRIX = 512
"""The compute loop's matrices are MATRIX x MATRIX."""


# ---------------------------------------------------------------------------------------------
# Inside a worker: one round


def block_params(width: int) -> int:
    """Parameters of one block: Linear(d, 4d), Linear(4d, d), LayerNorm(d)."""
    return 8 * width * width + 4 * width + width + 2 * width


def shape(params: int) -> tuple[int, int]:
    """The width and number of blocks for about ``params`` parameters."""
    width = WIDTH
    if params < block_params(width):
        width = max(8, int((params / 8) ** 0.5) // 8 * 8)
    return width, max(1, round(params / block_params(width)))


def build_state(params: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The training state (model and Adam after one step, plain values), the rank state, and
    a description."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    width, blocks = shape(params)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
        layers.append(nn.LayerNorm(width))
    model = nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(8, width)
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 1000,
        "epoch": 3,
        "config": {"name": "bench_ckpt", "lr": 1e-4, "betas": [0.9, 0.999], "width": width},
        "loss": 0.123,
    }
    rank_state = {"rng": torch.get_rng_state(), "seed": 0}
    n = sum(p.numel() for p in model.parameters())
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors(state))
    about = {"params": n, "width": width, "blocks": blocks, "tensor_bytes": tensor_bytes}
    return state, rank_state, about


def tensors(obj: Any) -> list[Any]:
    """Every tensor in a state."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def settle(*paths: Path) -> None:
    """Delete what a measurement wrote, then flush what is still dirty (untimed)."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    os.sync()


class Round:
    """One round's checkpointers, folders and compute loop."""

    def __init__(self, scratch: Path, compute_seconds: float) -> None:
        import torch

        from ups.ckpt import LocalCheckpointOptions
        from ups.ckpt.plugin import local_backend, sharded_backend
        from ups.core import RunContext

        self.scratch = scratch
        self.compute_seconds = compute_seconds
        ctx = RunContext()
        self.dirs = {k: scratch / k.replace("+", "-") for k in ("local", "sharded", "async")}
        self.ckpt = {
            "local": local_backend(
                ctx=ctx,
                directory=self.dirs["local"],
                options=LocalCheckpointOptions(keep_last=1, async_save=False),
            ),
            "sharded": sharded_backend(
                ctx=ctx,
                directory=self.dirs["sharded"],
                options=LocalCheckpointOptions(keep_last=1, async_save=False),
            ),
            "async": local_backend(
                ctx=ctx,
                directory=self.dirs["async"],
                options=LocalCheckpointOptions(keep_last=1, async_save=True),
            ),
        }
        generator = torch.Generator().manual_seed(1)
        self.a = torch.randn(MATRIX, MATRIX, generator=generator)
        self.b = torch.randn(MATRIX, MATRIX, generator=generator)
        self.c = torch.empty(MATRIX, MATRIX)
        self.n = 0

    def mm(self) -> None:
        import torch

        torch.mm(self.a, self.b, out=self.c)

    def run(self, kind: str, state: dict[str, Any], rank_state: dict[str, Any]) -> dict[str, Any]:
        """Measure ``kind`` once; the files it wrote are deleted (and ``os.sync()``) after."""
        import zlib

        import torch

        if kind.endswith("-t1"):  # the same with one intra-op thread
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return self.run(kind.removesuffix("-t1"), state, rank_state)
            finally:
                torch.set_num_threads(threads)

        from ups.core import dump

        self.n += 1
        file = self.scratch / f"{kind.replace('+', '-')}-{self.n}.pt"
        if kind == "torch.save":
            started = time.perf_counter()
            torch.save(state, file)
            ended = time.perf_counter()
            record = {"seconds": ended - started, "bytes": file.stat().st_size}
            settle(file)
            return record
        if kind == "torch.save+fsync":
            started = time.perf_counter()
            torch.save(state, file)
            saved = time.perf_counter()
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            ended = time.perf_counter()
            record = {
                "seconds": ended - started,
                "save_s": saved - started,
                "fsync_s": ended - saved,
                "bytes": file.stat().st_size,
            }
            settle(file)
            return record
        if kind == "dump+fsync":
            with open(file, "xb") as out:
                started = time.perf_counter()
                written = dump(dict(state), out)
                out.flush()
                dumped = time.perf_counter()
                os.fsync(out.fileno())
                ended = time.perf_counter()
            record = {
                "seconds": ended - started,
                "dump_s": dumped - started,
                "fsync_s": ended - dumped,
                "bytes": written.size,
            }
            settle(file)
            return record
        if kind == "crc32":
            views = [t.detach().reshape(-1).view(torch.uint8).numpy() for t in tensors(state)]
            started = time.perf_counter()
            crc = 0
            for view in views:
                crc = zlib.crc32(view, crc)
            ended = time.perf_counter()
            return {"seconds": ended - started, "bytes": sum(v.nbytes for v in views)}
        if kind == "copy":
            sources = tensors(state)
            targets = [torch.empty_like(t).fill_(0) for t in sources]  # touched: no page faults
            started = time.perf_counter()
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source)
            ended = time.perf_counter()
            return {"seconds": ended - started, "bytes": sum(t.nbytes for t in sources)}
        if kind in ("local", "sharded"):
            checkpointer = self.ckpt[kind]
            started = time.perf_counter()
            where = checkpointer.save(state, step=self.n, rank_state=rank_state)
            ended = time.perf_counter()
            record = {"seconds": ended - started, "bytes": folder_bytes(Path(where))}
            settle(Path(where))
            return record
        if kind == "async":
            return self._async(state, rank_state)
        if kind == "compute":
            self.mm()
            count = 0
            started = time.perf_counter()
            deadline = started + self.compute_seconds
            while (now := time.perf_counter()) < deadline:
                self.mm()
                count += 1
            return {"seconds": now - started, "iterations": count, "rate": count / (now - started)}
        raise ValueError(kind)

    def _async(self, state: dict[str, Any], rank_state: dict[str, Any]) -> dict[str, Any]:
        """The stall of a background save, then the compute loop until it has committed."""
        checkpointer = self.ckpt["async"]
        checkpointer.wait()  # nothing in flight: the warm-up's save, if any, is done
        done = threading.Event()
        failure: list[BaseException] = []
        committed_at: list[float] = []

        def await_commit() -> None:
            try:
                checkpointer.wait()
            except BaseException as error:  # re-raised on the training thread below
                failure.append(error)
            committed_at.append(time.perf_counter())
            done.set()

        first = time.perf_counter()  # the run's first save of this state: new staging memory
        primed = checkpointer.save(state, step=self.n, rank_state=rank_state)
        first = time.perf_counter() - first
        checkpointer.wait()
        settle(Path(primed))
        self.n += 1
        self.mm()
        started = time.perf_counter()
        where = checkpointer.save(state, step=self.n, rank_state=rank_state)
        returned = time.perf_counter()
        waiter = threading.Thread(target=await_commit, name="bench-wait")
        waiter.start()
        count = 0
        while not done.is_set():
            self.mm()
            count += 1
        looped = time.perf_counter()
        waiter.join()
        if failure:
            raise failure[0]
        window = looped - returned
        record = {
            "seconds": returned - started,
            "first_stall_s": first,
            "background_s": committed_at[0] - started,
            "loop_s": window,
            "iterations": count,
            "rate": count / window if window > 0 else float("nan"),
            "bytes": folder_bytes(Path(where)),
        }
        settle(Path(where))
        return record


def worker(order: list[str], params: int, compute_seconds: float, folder: Path) -> dict[str, Any]:
    """One round: build the state, warm up every kind on a tiny state, measure each in order."""
    import torch

    built = time.perf_counter()
    state, rank_state, about = build_state(params)
    built = time.perf_counter() - built
    scratch = Path(tempfile.mkdtemp(prefix="round-", dir=folder))
    try:
        measures = Round(scratch, compute_seconds=0.05)
        tiny = {"model": {"w": torch.zeros(256)}, "step": 0}
        for kind in order:  # the warm-up: every path once, the checkpointers' first saves
            measures.run(kind, tiny, rank_state)
        # and one full-size save: a process's first large write was seen to take 2-4 times
        # as long as the next ones, whichever kind came first
        warm_up = measures.run("torch.save", state, rank_state)
        measures.compute_seconds = compute_seconds
        os.sync()
        results = {kind: measures.run(kind, state, rank_state) for kind in order}
        for checkpointer in measures.ckpt.values():
            checkpointer.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "order": order,
        "state": about,
        "build_s": built,
        "warm_up_torch_save_s": warm_up["seconds"],
        "threads": torch.get_num_threads(),
        "results": results,
    }


# ---------------------------------------------------------------------------------------------
# The driver (no torch here: the workers import it)


def measure(order: list[str], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One round in a fresh process."""
    command = [sys.executable, str(HERE), "--worker", ",".join(order)]
    command += ["--params", str(args.params), "--compute-seconds", str(args.compute_seconds)]
    command += ["--dir", str(folder)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    if done.stderr:
        sys.stderr.write(done.stderr)
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return record


def ratio(values: list[float], target: float | None, at_least: bool) -> dict[str, Any]:
    """The median, min and max of per-round ratios, against ``target``."""
    result: dict[str, Any] = {"per_round": values, **summary(values)}
    if target is not None:
        met = result["median"] >= target if at_least else result["median"] <= target
        result.update(target=f"{'>=' if at_least else '<='} {target}", met=met)
    return result


def disk(folder: Path) -> dict[str, str]:
    """What ``df`` and ``lsblk`` say of the folder's filesystem and the disks (where they run)."""

    def run(*command: str) -> str:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"{command[0]}: {error}"
        return done.stdout.strip() or done.stderr.strip()

    return {
        "df": run("df", "-hT", str(folder)),
        "lsblk": run("lsblk", "-d", "-o", "NAME,ROTA,SIZE,TYPE,MODEL"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000, help="model parameters")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (one process each)")
    parser.add_argument(
        "--compute-seconds", type=float, default=3.0, help="how long the compute loop runs alone"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=ROOT / ".nox-reports" / "bench_ckpt-scratch",
        help="where the saves go (a folder made in it, deleted after)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "bench_ckpt.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.params < 1000 or args.repeats < 1 or args.compute_seconds <= 0:
        parser.error("--params must be at least 1000, --repeats at least 1, --compute-seconds > 0")
    if args.worker:
        order = args.worker.split(",")
        print(json.dumps(worker(order, args.params, args.compute_seconds, args.dir)))
        return 0

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="bench_ckpt-", dir=args.dir))
    width, blocks = shape(args.params)
    print(
        f"{blocks} blocks of width {width} (~{blocks * block_params(width):,} parameters) and "
        f"Adam's state; {args.repeats} rounds; saves under {folder}",
        flush=True,
    )
    began, load_before = time.perf_counter(), os.getloadavg()
    rounds: list[dict[str, Any]] = []
    try:
        for i in range(args.repeats):
            order = list(KINDS if i % 2 == 0 else KINDS[::-1])
            found = measure(order, args, folder)
            rounds.append(found)
            r = found["results"]
            print(
                f"  round {i + 1}/{args.repeats}: "
                + ", ".join(
                    f"{k} {r[k]['seconds']:.3f} s" for k in order if not k.startswith("compute")
                )
                + "".join(
                    f"; loop{s} {r[f'compute{s}']['rate']:.0f}/s alone, "
                    f"{r[f'async{s}']['rate']:.0f}/s during a background save of "
                    f"{r[f'async{s}']['background_s']:.2f} s"
                    for s in ("", "-t1")
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # the default folder, if nothing else is in it
            args.dir.rmdir()
    result = {
        "command": "nox -s bench_ckpt",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "threads": rounds[0]["threads"],
            "disk": disk(args.dir),
            "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        },
        "source": source_state("packages/ups-ckpt/src", "packages/ups-dist-core/src"),
        "settings": {
            "params": args.params,
            "repeats": args.repeats,
            "compute_seconds": args.compute_seconds,
            "matrix": MATRIX,
            "dir": str(args.dir),
        },
        "state": rounds[0]["state"],
        **analyse(rounds),
        "rounds": rounds,
        "wall_s": time.perf_counter() - began,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written: {args.out}")
    return 0


def analyse(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind, the spread of times, throughputs and parts; the ratios against targets."""
    per = [r["results"] for r in rounds]
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        runs = [p[kind] for p in per]
        entry: dict[str, Any] = {
            "label": LABELS[kind],
            "seconds": summary([x["seconds"] for x in runs]),
        }
        if "bytes" in runs[0]:
            entry["bytes"] = summary([x["bytes"] for x in runs])
            entry["mb_per_s"] = summary([x["bytes"] / x["seconds"] / 1e6 for x in runs])
        parts = ("save_s", "fsync_s", "dump_s", "first_stall_s", "background_s", "loop_s", "rate")
        for part in parts:
            if part in runs[0]:
                entry[part] = summary([x[part] for x in runs])
        kinds[kind] = entry

    def over(f: Any, target: float | None = None, at_least: bool = False) -> dict[str, Any]:
        return ratio([float(f(p)) for p in per], target, at_least)

    def t(p: dict[str, Any], kind: str) -> float:
        return float(p[kind]["seconds"])

    def cost(p: dict[str, Any], suffix: str) -> float:
        """What a background save costs the training in all: the stall, plus the loop's work
        lost while the save ran (its window x (1 - rate during / rate alone))."""
        during, alone = p[f"async{suffix}"], p[f"compute{suffix}"]
        return float(during["seconds"] + during["loop_s"] * (1 - during["rate"] / alone["rate"]))

    ratios = {
        "local_vs_torch_save": over(lambda p: t(p, "torch.save") / t(p, "local"), 0.9, True),
        "local_vs_torch_save_fsync": over(lambda p: t(p, "torch.save+fsync") / t(p, "local")),
        "sharded_vs_torch_save": over(lambda p: t(p, "torch.save") / t(p, "sharded")),
        "sharded_vs_torch_save_fsync": over(lambda p: t(p, "torch.save+fsync") / t(p, "sharded")),
    }
    for suffix in ("", "-t1"):
        key = suffix.replace("-", "_")
        ratios[f"async{key}_stall_vs_local"] = over(
            lambda p, s=suffix: t(p, f"async{s}") / t(p, "local"), 0.1 if not suffix else None
        )
        ratios[f"async{key}_first_stall_vs_local"] = over(
            lambda p, s=suffix: p[f"async{s}"]["first_stall_s"] / t(p, "local")
        )
        ratios[f"async{key}_background_vs_local"] = over(
            lambda p, s=suffix: p[f"async{s}"]["background_s"] / t(p, "local")
        )
        ratios[f"compute{key}_during_save_vs_alone"] = over(
            lambda p, s=suffix: p[f"async{s}"]["rate"] / p[f"compute{s}"]["rate"]
        )
        ratios[f"async{key}_cost_vs_local"] = over(lambda p, s=suffix: cost(p, s) / t(p, "local"))
        kinds[f"async{suffix}"]["cost_s"] = summary([cost(p, suffix) for p in per])
    return {"kinds": kinds, "ratios": ratios}


def table(r: dict[str, Any]) -> str:
    """The results as Markdown: a table of the kinds, then one of the ratios."""
    k, q, s = r["kinds"], r["ratios"], r["state"]

    def spread(c: dict[str, float], digits: int) -> str:
        return f"{c['median']:.{digits}f} [{c['min']:.{digits}f}, {c['max']:.{digits}f}]"

    def markdown(rows: list[tuple[str, ...]]) -> str:
        return "\n".join("| " + " | ".join(row) + " |" for row in rows)

    rows: list[tuple[str, ...]] = [
        ("measure", "time, s", "MB/s", "parts, s"),
        ("---", "---:", "---:", "---"),
    ]
    for kind, c in k.items():
        if kind.startswith("compute"):
            continue
        parts = []
        for part, name in (("save_s", "save"), ("dump_s", "dump"), ("fsync_s", "fsync")):
            if part in c:
                parts.append(f"{name} {spread(c[part], 3)}")
        if kind.startswith("async"):
            parts.append(f"a run's first save's stall {spread(c['first_stall_s'], 3)}")
            parts.append(f"save to commit {spread(c['background_s'], 3)}")
            parts.append(f"stall + compute lost {spread(c['cost_s'], 3)}")
        shown = "mb_per_s" in c and not kind.startswith("async")
        rows.append(
            (
                c["label"],
                spread(c["seconds"], 3),
                spread(c["mb_per_s"], 0) if shown else "",
                "; ".join(parts),
            )
        )
    for suffix, threads in (("", f"{r['machine']['threads']} threads"), ("-t1", "1 thread")):
        rows.append(
            (
                f"compute loop ({MATRIX}x{MATRIX} `torch.mm`, {threads}), iterations/s",
                "",
                "",
                f"alone {spread(k[f'compute{suffix}']['rate'], 0)}; during a background save "
                f"{spread(k[f'async{suffix}']['rate'], 0)}",
            )
        )
    ratios: list[tuple[str, ...]] = [
        ("ratio", "median [min, max] of the rounds", "target", "met"),
        ("---", "---:", "---", "---"),
    ]
    for label, key in (
        ("torch.save time / local time", "local_vs_torch_save"),
        ("(torch.save + fsync) time / local time", "local_vs_torch_save_fsync"),
        ("torch.save time / sharded time", "sharded_vs_torch_save"),
        ("(torch.save + fsync) time / sharded time", "sharded_vs_torch_save_fsync"),
        ("async stall / local time", "async_stall_vs_local"),
        ("async stall of a run's first save / local time", "async_first_stall_vs_local"),
        ("async save to commit / local time", "async_background_vs_local"),
        ("compute rate during a background save / alone", "compute_during_save_vs_alone"),
        ("async (stall + compute lost) / local time", "async_cost_vs_local"),
        ("1 thread: async stall / local time", "async_t1_stall_vs_local"),
        ("1 thread: async save to commit / local time", "async_t1_background_vs_local"),
        ("1 thread: compute rate during a save / alone", "compute_t1_during_save_vs_alone"),
        ("1 thread: async (stall + compute lost) / local time", "async_t1_cost_vs_local"),
    ):
        c = q[key]
        met = "" if "met" not in c else ("yes" if c["met"] else "**NO**")
        ratios.append((label, spread(c, 3), c.get("target", ""), met))
    header = (
        f"State: {s['params']:,} float32 parameters ({s['blocks']} blocks of width "
        f"{s['width']}) and Adam's state, {s['tensor_bytes'] / 1e9:.2f} GB of tensors; "
        f"{r['settings']['repeats']} rounds, one process each; median [min, max] over the rounds."
    )
    return f"{header}\n\n{markdown(rows)}\n\n{markdown(ratios)}"


if __name__ == "__main__":
    sys.exit(main())
