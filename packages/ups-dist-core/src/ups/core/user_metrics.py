"""User metrics: numbers a user function computes on each training batch, aggregated over the
batches of a report and over all ranks as declared (``mean``, ``sum`` or ``max``).

Ranks must report the same metric names. At each report the ranks first compare their sets of
names with one all-reduce of two numbers; if they differ, every rank raises
:class:`MetricNamesError` saying which rank has which names, instead of entering all-reduces of
different shapes and deadlocking (Lightning-AI/pytorch-lightning#19106). The values then travel
in at most two all-reduces, not waited for (like the loss's).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .context import RunContext
from .errors import ConfigError, UsageError

MetricFn = Callable[[torch.Tensor, torch.Tensor], Mapping[str, Any]]
"""``fn(outputs, targets)``: a batch's metrics, as numbers or 0-d tensors."""


class MetricNamesError(UsageError):
    """Ranks reported different sets of metric names."""


class UserMetrics:
    """One rank's user metrics since the last report."""

    def __init__(self, fn: MetricFn, reduce: Mapping[str, str], device: torch.device) -> None:
        self._fn, self._reduce, self._device = fn, dict(reduce), device
        self._sums: dict[str, torch.Tensor] = {}
        """``mean``: [sum of value x batch size, samples]; ``sum``: [sum, 0]; ``max``: [max, 0]."""

    def compute(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The user function's metrics of a batch, as float64 0-d tensors (no host sync).

        :raises ConfigError: naming a metric whose value is not a single number.
        """
        with torch.no_grad():
            values = self._fn(outputs.detach(), targets)
        metrics = {}
        for name, value in values.items():
            tensor = torch.as_tensor(value).detach().to(self._device, torch.float64)
            if tensor.numel() != 1:
                raise ConfigError(
                    "metrics.factory",
                    f"metric {name!r} is not one number (a tensor of shape {tuple(tensor.shape)})",
                )
            metrics[name] = tensor.reshape(())
        return metrics

    def add(self, values: Mapping[str, torch.Tensor], batch_size: int) -> None:
        """Add one batch's metrics (from :meth:`compute`) of ``batch_size`` samples."""
        for name, value in values.items():
            how = self._reduce.get(name, "mean")
            entry = self._sums.get(name)
            if entry is None:
                start = -torch.inf if how == "max" else 0.0
                entry = torch.tensor([start, 0.0], dtype=torch.float64, device=self._device)
                self._sums[name] = entry
            if how == "max":
                entry[0] = torch.maximum(entry[0], value)
            elif how == "sum":
                entry[0] += value
            else:
                entry[0] += value * batch_size
                entry[1] += batch_size

    def report(self, ctx: RunContext) -> PendingMetrics:
        """Start aggregating the window over all ranks and start a new window. A collective:
        every rank calls it at the same step.

        :raises MetricNamesError: on every rank, when the ranks' metric names differ.
        """
        names = sorted(self._sums)
        sums, self._sums = self._sums, {}
        if ctx.distributed:
            _check_same_names(ctx, names)
        groups = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
        pending = []
        for how, op in groups.items():
            chosen = [n for n in names if (self._reduce.get(n, "mean") == "max") == (how == "max")]
            if not chosen:
                continue
            stacked = torch.stack([sums[n] for n in chosen])
            work = dist.all_reduce(stacked, op=op, async_op=True) if ctx.distributed else None
            pending.append((chosen, stacked, work))
        return PendingMetrics(self._reduce, pending)


class PendingMetrics:
    """A window's user metrics on their way over the ranks."""

    def __init__(
        self, reduce: Mapping[str, str], pending: list[tuple[list[str], torch.Tensor, Any]]
    ) -> None:
        self._reduce, self._pending = reduce, pending

    def result(self) -> dict[str, float]:
        """Each metric, reduced over the window's batches on all ranks."""
        metrics = {}
        for names, stacked, work in self._pending:
            if work is not None:
                work.wait()
            for name, (value, samples) in zip(names, stacked.tolist(), strict=True):
                mean = self._reduce.get(name, "mean") == "mean"
                metrics[name] = (value / samples if samples else float("nan")) if mean else value
        return metrics


def _check_same_names(ctx: RunContext, names: list[str]) -> None:
    digest = zlib.crc32("\n".join(names).encode())
    # max and -min in one all-reduce: equal on every rank exactly when every digest is equal.
    spread = torch.tensor([digest, -digest], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    if spread[0] == -spread[1]:
        return
    everyone: list[list[str] | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, names)
    listed = "; ".join(
        f"rank {rank}: {', '.join(n or ['(none)'])}" for rank, n in enumerate(everyone)
    )
    raise MetricNamesError(
        f"metrics.factory: the ranks report different metric names ({listed}); "
        "every rank must return the same names on every batch"
    )
