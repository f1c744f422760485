"""Where a run's time, memory and bytes go: a torch.profiler trace of a few steps, compute against
communication, the bytes of gradient communication and the throughput metrics the engine
reports.

Every rank profiles itself; what ranks must agree on (when to start a timed phase, whether a
phase failed, the table of results) they agree on with collectives that every rank calls.
"""

from __future__ import annotations

import math
import numbers
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, schedule

from ..config._errors import UsageError
from ..dist._collectives import Agreement, Failure, RankFailedError
from ..dist._context import RunContext

log = structlog.get_logger()

__all__ = [
    "CommCounter",
    "CommProfile",
    "RankComm",
    "StepProfiler",
    "comm_profile",
    "gradient_bytes",
    "model_counts",
    "peak_memory_mb",
    "throughput",
]


class StepProfiler:
    """Profile ``steps`` training steps of this rank with :mod:`torch.profiler`, once.

    The first step is skipped (DDP builds its gradient buckets there) and the next one warms the
    profiler up; the ``steps`` after it are recorded, with shapes and memory, on the CPU and, when
    the rank computes on CUDA, on the GPU. When they end, the Chrome trace is written to
    ``folder/profile/rank<r>.json`` (open it in Perfetto or ``chrome://tracing``) and profiling
    stops: later steps run without its overhead.

    Use it as a context manager around the training loop and call :meth:`step` after every
    optimizer step. If the loop ends before the profiled steps do, no trace is written and a
    warning says how many steps were profiled of those asked for::

        with StepProfiler(ctx, run_dir, steps=3) as profiler:
            for batch in batches:
                train_step(batch)
                profiler.step()
    """

    def __init__(self, ctx: RunContext, folder: Path, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1, not {steps}")
        self._ctx = ctx
        self._steps = steps
        self._path = folder / "profile" / f"rank{ctx.rank}.json"
        self._taken = 0
        self._profile: profile | None = None
        self._written = False

    @property
    def trace(self) -> Path | None:
        """The Chrome trace's path once it is written, else ``None``."""
        return self._path if self._written else None

    def __enter__(self) -> StepProfiler:
        activities = [ProfilerActivity.CPU]
        if self._ctx.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(skip_first=1, wait=0, warmup=1, active=self._steps, repeat=1),
            on_trace_ready=self._export,
            record_shapes=True,
            profile_memory=True,
        )
        self._profile.__enter__()  # type: ignore[no-untyped-call]
        return self

    def step(self) -> None:
        """Tell the profiler a training step ended; a no-op once the trace is written."""
        if self._profile is None:
            return
        self._taken += 1
        self._profile.step()
        if self._written:
            self._stop()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._profile is None:
            return
        self._stop()
        if not self._written:
            log.warning(
                "training ended before the profile did: no trace written",
                rank=self._ctx.rank,
                profiled_steps=min(max(self._taken - 2, 0), self._steps),
                asked_steps=self._steps,
            )

    def _export(self, prof: profile) -> None:
        # torch also hands over a trace when the profiler stops early: leave no partial one.
        if self._taken < 2 + self._steps:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        partial = self._path.with_suffix(".json.partial")
        prof.export_chrome_trace(str(partial))
        partial.replace(self._path)
        self._written = True

    def _stop(self) -> None:
        profiler, self._profile = self._profile, None
        if profiler is not None:
            profiler.__exit__(None, None, None)  # type: ignore[no-untyped-call]


@attrs.frozen(kw_only=True)
class RankComm:
    """One rank's side of a :func:`comm_profile`; times are seconds per step."""

    rank: int
    compute_s: float
    """Forward and backward without gradient synchronisation."""
    total_s: float
    """Forward and backward with DDP's gradient synchronisation."""
    comm_s: float
    """What synchronising added: ``max(total_s - compute_s, 0)``."""
    comm_share: float
    """``comm_s / total_s``, from 0 to 1."""
    peak_memory_mb: float
    """This rank's :func:`peak_memory_mb` after profiling."""


@attrs.frozen(kw_only=True)
class CommProfile:
    """Every rank's :class:`RankComm`, in rank order; the same on every rank."""

    iterations: int
    ranks: tuple[RankComm, ...]

    def summary(self) -> dict[str, float]:
        """Over the ranks: mean ``compute_s``, ``total_s`` and ``comm_s``; ``comm_share`` of
        the mean step; the worst rank's share (``max_comm_share``) and the largest
        ``peak_memory_mb``. Flat, for a log line."""
        n = len(self.ranks)
        compute = sum(r.compute_s for r in self.ranks) / n
        total = sum(r.total_s for r in self.ranks) / n
        comm = sum(r.comm_s for r in self.ranks) / n
        return {
            "compute_s": compute,
            "total_s": total,
            "comm_s": comm,
            "comm_share": comm / total if total > 0 else 0.0,
            "max_comm_share": max(r.comm_share for r in self.ranks),
            "peak_memory_mb": max(r.peak_memory_mb for r in self.ranks),
        }

    def as_dict(self) -> dict[str, Any]:
        """The summary and the per-rank table, as JSON-ready values."""
        return {
            "iterations": self.iterations,
            "summary": self.summary(),
            "ranks": [attrs.asdict(r) for r in self.ranks],
        }


def comm_profile(
    ctx: RunContext, step: Callable[[bool], None], iterations: int = 10
) -> CommProfile:
    """Measure how much of a training step gradient synchronisation takes, on every rank.

    ``step(sync)`` runs one forward and backward pass: with DDP's gradient all-reduce when
    ``sync`` is true, without any collective when it is false (through the bare module). Each
    phase (without, then with) runs one warm-up step, then ``iterations`` timed steps. Before a
    phase's clock starts every rank agrees its warm-up went well, with an all-reduce, so all
    ranks start each timed phase together; CUDA is synchronised around the timings.

    A collective: every rank calls it, and every rank returns the same :class:`CommProfile`.
    If ``step`` raises on a rank, every rank raises :class:`~ups.core.RankFailedError` naming
    it (a rank that fails inside DDP's all-reduce leaves the others waiting there, as in
    training, until the process group's timeout).
    """
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, not {iterations}")
    compute_s = _phase(ctx, step, False, iterations)
    total_s = _phase(ctx, step, True, iterations)
    comm_s = max(total_s - compute_s, 0.0)
    mine = RankComm(
        rank=ctx.rank,
        compute_s=compute_s,
        total_s=total_s,
        comm_s=comm_s,
        comm_share=comm_s / total_s if total_s > 0 else 0.0,
        peak_memory_mb=peak_memory_mb(ctx.device),
    )
    ranks: list[Any] = [mine]
    if ctx.distributed:
        ranks = [None] * ctx.world_size
        dist.all_gather_object(ranks, mine)
    return CommProfile(iterations=iterations, ranks=tuple(ranks))


def _phase(ctx: RunContext, step: Callable[[bool], None], sync: bool, iterations: int) -> float:
    """Seconds per ``step(sync)`` over ``iterations`` steps, after one warm-up step."""
    _agreed_seconds(ctx, step, sync, 1)
    return _agreed_seconds(ctx, step, sync, iterations) / iterations


def _agreed_seconds(
    ctx: RunContext, step: Callable[[bool], None], sync: bool, iterations: int
) -> float:
    """Run ``step(sync)`` ``iterations`` times and return how long it took; then agree with
    every rank that none failed (an all-reduce: no rank goes on before all got here)."""

    def failed(failures: list[Failure], _error: Exception | None) -> RankFailedError:
        first = failures[0]
        return RankFailedError.naming(f"comm_profile (sync={sync}): {first}", first)

    _synchronize(ctx.device)
    start = time.perf_counter()
    with Agreement(ctx, failed):
        for _ in range(iterations):
            step(sync)
        _synchronize(ctx.device)
        seconds = time.perf_counter() - start
    return seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gradient_bytes(ddp: DistributedDataParallel) -> int:
    """What plain all-reduce hands to the collective each step: every gradient, in its dtype."""
    return sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)


class CommCounter:
    """The bytes of gradient communication per optimizer step, for the engine's reports.

    ``allreduce_bytes`` is what plain all-reduce hands over (:func:`gradient_bytes`).
    ``comm_bytes`` is what the comm hook handed, as its state's ``comm_metrics(steps)`` reports
    it (with whatever else it reports, such as per-bucket times); ``comm_ratio`` is their
    ratio. A hook whose state has no ``comm_metrics`` gets ``allreduce_bytes`` only. A run
    without DDP (one process) gets nothing.
    """

    def __init__(
        self, ddp: DistributedDataParallel | None = None, state: object | None = None
    ) -> None:
        self._plain = None if ddp is None else float(gradient_bytes(ddp))
        self._report: Callable[[int], Any] | None = getattr(state, "comm_metrics", None)

    def metrics(self, steps: int) -> dict[str, float]:
        """The metrics of the ``steps`` optimizer steps since the last call (none for 0)."""
        if self._plain is None or steps < 1:
            return {}
        metrics: dict[str, float] = {}
        if self._report is not None:
            metrics |= self._report(steps)
        metrics["allreduce_bytes"] = self._plain
        if "comm_bytes" in metrics and self._plain > 0:
            metrics["comm_ratio"] = metrics["comm_bytes"] / self._plain
        return metrics


def peak_memory_mb(device: torch.device) -> float:
    """The most memory this process has held so far, in MiB: on CUDA, the tensors allocated on
    ``device`` (:func:`torch.cuda.max_memory_allocated`); on the CPU, the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux counts kibibytes, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def throughput(
    samples: float,
    seconds: float,
    *,
    world_size: int,
    flops_per_sample: float | None = None,
    tokens_per_sample: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """Throughput of ``samples``, counted over all ranks, trained in ``seconds``.

    Returns ``samples_per_s``; ``tokens_per_s`` when ``tokens_per_sample`` is known;
    ``tflops`` (achieved by all ranks together, in 10^12 FLOP/s) when ``flops_per_sample`` is
    known; and ``mfu``, the model FLOPs utilisation ``achieved / (peak_flops * world_size)``,
    when ``peak_flops`` (one device's peak, FLOP/s) is known too.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, not {seconds}")
    samples_per_s = samples / seconds
    metrics = {"samples_per_s": samples_per_s}
    if tokens_per_sample is not None:
        metrics["tokens_per_s"] = samples_per_s * tokens_per_sample
    if flops_per_sample is not None:
        achieved = samples_per_s * flops_per_sample
        metrics["tflops"] = achieved / 1e12
        if peak_flops is not None:
            metrics["mfu"] = achieved / (peak_flops * world_size)
    return metrics


def model_counts(model: nn.Module) -> tuple[float | None, float | None]:
    """``(flops_per_sample, tokens_per_sample)`` as ``model`` states them, or ``None`` each.

    A model says how to count by having an attribute ``flops_per_sample`` (FLOPs of one
    sample's forward and backward pass; ``6 * parameters * tokens`` for a transformer) and/or
    ``tokens_per_sample``: a positive number, or a callable taking no arguments that returns
    one. A model wrapped in DDP is read through ``.module``.

    :raises UsageError: when an attribute is there but is not such a number.
    """
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return _count(model, "flops_per_sample"), _count(model, "tokens_per_sample")


def _count(model: nn.Module, name: str) -> float | None:
    value = getattr(model, name, None)
    if callable(value):
        value = value()
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise UsageError(
            f"{type(model).__name__}.{name} must be a positive number, or a callable taking no "
            f"arguments that returns one; got {value!r}"
        )
    return float(value)
