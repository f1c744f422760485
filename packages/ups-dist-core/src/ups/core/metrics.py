"""Training metrics summed locally between reports and aggregated over all ranks at each one.

Every report is one all-reduce of a small tensor, whatever the number of tasks: per task, the
sum of per-sample losses and the sample count. It is asynchronous: the engine reads the result
one step later, so no rank waits on it (nor on rank 0's logging) before its next step. Ranks always agree on the tasks (``data.tasks``),
so their tensors have one shape and the collective cannot mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .context import RunContext
from .errors import ConfigError

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mse": lambda out, y: nn.functional.mse_loss(out, y, reduction="none"),
    "l1": lambda out, y: nn.functional.l1_loss(out, y, reduction="none"),
    "cross_entropy": lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
}
"""The loss functions ``training.loss`` names, unreduced."""


def per_sample_losses(loss: str, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One loss per sample (float32): the loss ``loss`` names, averaged over all but the first
    dimension. A batch's loss is their mean."""
    unreduced = LOSSES[loss](outputs, targets).float()
    return unreduced.reshape(len(outputs), -1).mean(dim=1)


class LossWindow:
    """Per-task loss sums and counts since the last report, on this rank."""

    def __init__(self, tasks: Sequence[str], device: torch.device) -> None:
        self.tasks = tuple(tasks) or ("all",)
        self._sums = torch.zeros(2, len(self.tasks), dtype=torch.float64, device=device)
        self._checked = False

    def add(self, per_sample: torch.Tensor, task_ids: torch.Tensor | None) -> None:
        """Add a batch's per-sample losses (detached), each to its task; without declared
        tasks (``data.tasks``) task ids are ignored and every sample counts as one task.

        :raises ConfigError: (on the first batch) when a task id has no name in ``data.tasks``.
        """
        losses = per_sample.detach().to(torch.float64)
        if task_ids is None or len(self.tasks) == 1:
            ids = torch.zeros_like(losses, dtype=torch.long)
        else:
            ids = task_ids.to(losses.device, torch.long)
            if not self._checked:  # one host sync, on the first batch only
                self._checked = True
                if int(ids.max()) >= len(self.tasks) or int(ids.min()) < 0:
                    raise ConfigError(
                        "data.tasks",
                        f"names {len(self.tasks)} tasks but a batch carries task id "
                        f"{int(ids.max())}; name one task per id, in id order",
                    )
        self._sums[0].index_add_(0, ids, losses)
        self._sums[1].index_add_(0, ids, torch.ones_like(losses))

    def report(self, ctx: RunContext) -> PendingReport:
        """Start aggregating the window over all ranks (an all-reduce, not waited for) and
        start a new window. A collective: every rank calls it at the same step."""
        sums = self._sums.clone()
        self._sums.zero_()
        work = dist.all_reduce(sums, async_op=True) if ctx.distributed else None
        return PendingReport(self.tasks, sums, work)


class PendingReport:
    """A window's metrics on their way: the all-reduce overlaps the next step's compute."""

    def __init__(self, tasks: tuple[str, ...], sums: torch.Tensor, work: Any) -> None:
        self._tasks, self._sums, self._work = tasks, sums, work

    def result(self) -> dict[str, float]:
        """The mean loss over all ranks' samples of the window, overall and per task
        (``loss/<task>``) when there are tasks, and the number of ``samples``."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        total, count = self._sums.sum(dim=1).tolist()
        metrics = {"loss": total / count if count else float("nan")}
        if len(self._tasks) > 1:
            for task, (s, n) in zip(self._tasks, self._sums.T.tolist(), strict=True):
                metrics[f"loss/{task}"] = s / n if n else float("nan")
        metrics["samples"] = count
        return metrics
