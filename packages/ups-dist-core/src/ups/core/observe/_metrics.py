"""Training metrics summed locally between reports and aggregated over all ranks at each one.

Every report is one all-reduce of a small tensor, whatever the number of tasks: per task, the
sum of per-sample losses and the sample count. It is asynchronous: the engine reads the result
one step later, so no rank waits on it (nor on rank 0's logging) before its next step. Ranks always agree on the tasks (``data.tasks``),
so their tensors have one shape and the collective cannot mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config._errors import ConfigError
from ..dist._context import RunContext

HELD = 32
"""Batches of per-sample losses a :class:`LossWindow` holds before adding them to its sums."""


class LossWindow:
    """Per-task loss sums and counts since the last report, on this rank.

    A column per task, and one more for losses given as a batch's mean (a step whose loss is
    not per sample), which count in ``loss`` but in no ``loss/<task>``. Losses are held as they
    come and added :data:`HELD` batches at a time: a few tensor operations every ``HELD``
    steps rather than every step.
    """

    def __init__(self, tasks: Sequence[str], device: torch.device) -> None:
        """:raises ConfigError: when ``tasks`` is not a sequence of names (one string is not)."""
        if isinstance(tasks, str) or not all(isinstance(task, str) for task in tasks):
            raise ConfigError("tasks", f"expected a list of task names, got {tasks!r}")
        self.tasks = tuple(tasks) or ("all",)
        self._sums = torch.zeros(2, len(self.tasks) + 1, dtype=torch.float64, device=device)
        self._ids = TaskIds(len(self.tasks))
        self._held: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._held_means: list[tuple[torch.Tensor, int]] = []

    def add(self, per_sample: torch.Tensor, task_ids: torch.Tensor | None) -> None:
        """Add a batch's per-sample losses (detached), each to its task; without declared
        tasks (``data.tasks``) task ids are ignored and every sample counts as one task.

        :raises ConfigError: (on the first batch) when a task id has no name in ``data.tasks``.
        """
        losses = per_sample.detach()
        if task_ids is not None and self._ids.tasks > 1 and not self._ids.checked:
            self._ids.index(task_ids, losses)  # raises here, at the first batch
        self._held.append((losses, task_ids))
        if len(self._held) == HELD:
            self._add_held()

    def _add_held(self) -> None:
        """Add the held batches' losses to the sums, each to its task."""
        if self._held_means:
            means, self._held_means = self._held_means, []
            values = torch.stack([mean for mean, _ in means]).to(torch.float64)
            counts = [count for _, count in means]
            weights = torch.tensor(counts, dtype=torch.float64).to(values.device)
            self._sums[0, -1] += values @ weights
            self._sums[1, -1] += sum(counts)
        if not self._held:
            return
        held, self._held = self._held, []
        losses = torch.cat([batch for batch, _ in held])  # each [samples]
        if self._ids.tasks == 1:
            self._sums[0, 0] += losses.sum(dtype=torch.float64)
            self._sums[1, 0] += len(losses)
            return
        losses = losses.to(torch.float64)
        ids = torch.cat([self._ids.index(task_ids, batch) for batch, task_ids in held])
        self._sums[0].index_add_(0, ids, losses)
        self._sums[1].index_add_(0, ids, torch.ones_like(losses))

    def add_mean(self, mean: torch.Tensor, samples: int) -> None:
        """Add a batch's mean loss over ``samples`` samples (no task: not per sample); held
        as per-sample losses are."""
        self._held_means.append((mean.detach(), samples))
        if len(self._held_means) == HELD:
            self._add_held()

    def finite(self) -> bool:
        """Whether every loss added since the last report was finite (a host sync)."""
        self._add_held()
        return bool(torch.isfinite(self._sums).all())

    def state_dict(self) -> dict[str, Any]:
        """The window so far (this rank's sums and counts per task), to save with a checkpoint
        taken between reports: a resumed loop's next report then covers the same steps as an
        unstopped one's. A host sync."""
        self._add_held()
        return {"tasks": list(self.tasks), "sums": self._sums.cpu().clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a window :meth:`state_dict` saved.

        :raises ConfigError: when it was saved with other tasks.
        """
        if list(state["tasks"]) != list(self.tasks):
            raise ConfigError(
                "tasks",
                f"the saved window has tasks {list(state['tasks'])}, this one {list(self.tasks)}",
            )
        self._held, self._held_means = [], []
        self._sums = state["sums"].to(self._sums.device, self._sums.dtype).clone()

    def report(self, ctx: RunContext, also: torch.Tensor | None = None) -> PendingReport:
        """Start aggregating the window over all ranks (an all-reduce, not waited for) and
        start a new window. ``also``: more numbers to sum over the ranks in the same
        all-reduce (float64, on the device; the same length on every rank), read back as
        :attr:`PendingReport.also`. A collective: every rank calls it at the same step."""
        self._add_held()
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        flat = sums.reshape(-1) if also is None else torch.cat([sums.reshape(-1), also])
        work = dist.all_reduce(flat, async_op=True) if ctx.distributed else None
        return PendingReport(self.tasks, flat, work, sums.shape)


class PendingReport:
    """A window's metrics on their way: the all-reduce overlaps the next step's compute."""

    def __init__(
        self, tasks: tuple[str, ...], flat: torch.Tensor, work: Any, shape: torch.Size
    ) -> None:
        self._tasks, self._flat, self._work, self._shape = tasks, flat, work, shape
        self.also: list[float] = []
        """The ``also`` numbers summed over the ranks, once :meth:`result` has read them."""

    def result(self) -> dict[str, float]:
        """The mean loss over all ranks' samples of the window, overall and per task
        (``loss/<task>``) when there are tasks, and the number of ``samples``."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        flat = self._flat.tolist()  # one read from the device
        size = self._shape.numel()
        columns = size // 2
        values, counts, self.also = flat[:columns], flat[columns:size], flat[size:]
        metrics = means("loss", self._tasks, values, counts)
        metrics["samples"] = sum(counts)
        return metrics


def per_task(name: str, tasks: tuple[str, ...], sums: torch.Tensor) -> dict[str, float]:
    """``name``'s mean over all samples and, with several tasks, ``name/<task>``'s, from
    ``sums`` (``[2, columns]``: sums and counts, a column per task, then any further ones
    that count in the overall mean only)."""
    return means(name, tasks, *sums.tolist())


def means(
    name: str, tasks: tuple[str, ...], values: list[float], counts: list[float]
) -> dict[str, float]:
    """:func:`per_task`'s means from the sums' two rows, read already."""
    total, count = sum(values), sum(counts)
    metrics = {name: total / count if count else float("nan")}
    if len(tasks) > 1:
        for task, s, n in zip(tasks, values, counts, strict=False):
            metrics[f"{name}/{task}"] = s / n if n else float("nan")
    return metrics


class TaskIds:
    """Turns a batch's task ids into column indices, checking them once against the tasks."""

    def __init__(self, tasks: int) -> None:
        self.tasks = tasks
        self.checked = False
        """Whether a batch's ids were checked (the first batch's are)."""

    def index(self, task_ids: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
        """The column of each of ``values`` (every sample in column 0 with one task or none).

        :raises ConfigError: (on the first batch) when a task id has no name in ``data.tasks``,
            or the ids are not one per sample.
        """
        if task_ids is None or self.tasks == 1:
            return torch.zeros(len(values), dtype=torch.long, device=values.device)
        ids = task_ids.to(values.device, torch.long).reshape(-1)
        if not self.checked:  # one host sync, on the first batch only
            self.checked = True
            if len(ids) != len(values):
                raise ConfigError(
                    "step.task",
                    f"gave {len(ids)} task ids for a batch of {len(values)} samples; "
                    "expected one per sample",
                )
            if int(ids.max()) >= self.tasks or int(ids.min()) < 0:
                raise ConfigError(
                    "data.tasks",
                    f"names {self.tasks} tasks but a batch carries task id "
                    f"{int(ids.max())}; name one task per id, in id order",
                )
        return ids
