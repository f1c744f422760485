"""User metrics: what a step's ``metrics`` returns for each batch, aggregated over the batches
of a report and over all ranks: a number as declared (``mean``, ``sum`` or ``max``), a value per
sample as a mean over the samples, overall and per task.

Ranks must report the same metric names. At each report the ranks first compare their sets of
names with one all-reduce of two numbers; if they differ, every rank raises
:class:`MetricNamesError` saying which rank has which names, instead of entering all-reduces of
different shapes and deadlocking (Lightning-AI/pytorch-lightning#19106). The values then travel
in at most two all-reduces, not waited for (like the loss's).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..config._errors import ConfigError, UsageError
from ..dist._context import RunContext
from ._metrics import TaskIds, per_task


class MetricNamesError(UsageError):
    """Ranks reported different sets of metric names."""


class UserMetrics:
    """One rank's user metrics since the last report: a step's :meth:`~ups.core.Step.metrics`
    of each micro-batch, a number per name or one per sample (averaged, and per task)."""

    def __init__(
        self,
        reduce: Mapping[str, str],
        tasks: tuple[str, ...],
        device: torch.device,
        key: str = "step.metrics",
        *,
        measured: bool = True,
    ) -> None:
        self._reduce, self._tasks, self._device = dict(reduce), tasks, device
        self.key = key
        """The config key of the code the metrics come from (for messages)."""
        self.measured = measured
        """Whether batches may carry metrics; without, a report makes no collective (no
        names to compare, no sums to add)."""
        self._ids = TaskIds(len(tasks))
        self._sums: dict[str, torch.Tensor] = {}
        """A number: ``mean``: [sum of value x batch size, samples]; ``sum``: [sum, 0];
        ``max``: [max, 0]. Per sample: [sums, counts] per task (``[2, tasks]``)."""

    def check(self, values: Mapping[str, Any], batch_size: int) -> dict[str, torch.Tensor]:
        """A batch's metrics as float64 tensors on the device (no host sync): 0-d for a number,
        ``[batch_size]`` for one value per sample.

        :raises ConfigError: naming a metric that is neither.
        """
        metrics = {}
        for name, value in values.items():
            tensor = torch.as_tensor(value).detach().to(self._device, torch.float64)
            if tensor.dim() == 1 and len(tensor) == batch_size:
                metrics[name] = tensor
            elif tensor.numel() == 1:
                metrics[name] = tensor.reshape(())
            else:
                raise ConfigError(
                    self.key,
                    f"metric {name!r} is a tensor of shape {tuple(tensor.shape)}; expected one "
                    f"number, or one per sample (shape ({batch_size},))",
                )
        return metrics

    def add(self, values: Mapping[str, torch.Tensor], batch_size: int, task_ids: Any) -> None:
        """Add one batch's metrics (from :meth:`check`) of ``batch_size`` samples."""
        for name, value in values.items():
            how = self._reduce.get(name, "mean")
            entry = self._sums.get(name)
            if value.dim() == 1:
                if entry is None:
                    entry = self._sums[name] = value.new_zeros(2, len(self._tasks))
                ids = self._ids.index(task_ids, value)
                entry[0].index_add_(0, ids, value)
                entry[1].index_add_(0, ids, torch.ones_like(value))
                continue
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sums since the last report, copied: what a rollback puts back
        (:mod:`~ups.core.engine._snapshot`), so that replayed steps are counted once."""
        return {name: entry.clone() for name, entry in self._sums.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Go on from the sums :meth:`state_dict` gave (copied again)."""
        self._sums = {name: entry.clone() for name, entry in state.items()}

    def report(self, ctx: RunContext) -> PendingMetrics:
        """Start aggregating the window over all ranks and start a new window. A collective:
        every rank calls it at the same step.

        :raises MetricNamesError: on every rank, when the ranks' metric names differ.
        """
        names = sorted(self._sums)
        sums, self._sums = self._sums, {}
        if ctx.distributed and self.measured:
            _check_same_names(ctx, names)
        pending = []
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.SUM):
            chosen = [n for n in names if self._op(n, sums[n]) == op]
            if not chosen:
                continue
            flat = torch.cat([sums[n].reshape(-1) for n in chosen])
            work = dist.all_reduce(flat, op=op, async_op=True) if ctx.distributed else None
            shapes = [sums[n].shape for n in chosen]
            pending.append((chosen, shapes, flat, work))
        return PendingMetrics(self._reduce, self._tasks, pending)

    def _op(self, name: str, entry: torch.Tensor) -> Any:
        per_sample = entry.dim() == 2
        return (
            dist.ReduceOp.MAX
            if self._reduce.get(name) == "max" and not per_sample
            else dist.ReduceOp.SUM
        )


class PendingMetrics:
    """A window's user metrics on their way over the ranks."""

    def __init__(
        self,
        reduce: Mapping[str, str],
        tasks: tuple[str, ...],
        pending: list[tuple[list[str], list[torch.Size], torch.Tensor, Any]],
    ) -> None:
        self._reduce, self._tasks, self._pending = reduce, tasks, pending

    def result(self) -> dict[str, float]:
        """Each metric, reduced over the window's batches on all ranks; a per-sample metric
        also per task (``name/<task>``) with several tasks."""
        metrics: dict[str, float] = {}
        for names, shapes, flat, work in self._pending:
            if work is not None:
                work.wait()
            parts = torch.split(flat, [shape.numel() for shape in shapes])
            for name, shape, part in zip(names, shapes, parts, strict=True):
                if len(shape) == 2:
                    metrics |= per_task(name, self._tasks, part.reshape(shape))
                    continue
                value, samples = part.tolist()
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
