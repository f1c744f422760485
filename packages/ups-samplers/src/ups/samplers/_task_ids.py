"""Task ids on every sample of multi-task data, for per-task metrics."""

from __future__ import annotations

import bisect
from typing import Any

from torch.utils.data import ConcatDataset


class WithTaskIds(ConcatDataset[tuple[Any, ...]]):
    """A ``ConcatDataset`` of one dataset per task whose samples end with their task's index:
    ``(*sample, task)`` (a sample that is not a tuple becomes ``(sample, task)``), so ups's
    engine reports the loss per task (``data.tasks`` names them, in this order). Build it
    from the tasks' datasets, e.g. ``WithTaskIds(concat.datasets)``; the ``multitask`` sampler
    takes it as any ``ConcatDataset``.
    """

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if index < 0:
            if -index > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            index += len(self)
        sample = super().__getitem__(index)  # type: ignore[no-untyped-call]
        task = bisect.bisect_right(self.cumulative_sizes, index)
        return (*sample, task) if isinstance(sample, tuple) else (sample, task)
