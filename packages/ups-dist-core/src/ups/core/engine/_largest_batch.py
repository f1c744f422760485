"""Find the largest per-rank batch size that fits in memory on every rank.

Every rank tries the same sizes in the same order: after each trial the ranks agree, with one
small all-reduce, whether it fitted everywhere, so they all take the same next step and return
the same answer.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import structlog
import torch

from ..dist._collectives import Agreement, Failure, RankFailedError
from ..dist._context import RunContext

log = structlog.get_logger()

__all__ = ["BatchSizeError", "find_batch_size"]


class BatchSizeError(RuntimeError):
    """Raised on every rank when even the smallest batch size tried runs out of memory."""


def find_batch_size(
    ctx: RunContext, trial: Callable[[int], None], *, start: int = 1, limit: int | None = None
) -> int:
    """The largest per-rank batch size from ``start`` up to ``limit`` that fits on every rank.

    ``trial(b)`` runs one training step at per-rank batch size ``b``; running out of memory
    (:class:`torch.OutOfMemoryError`, or a ``RuntimeError`` saying "out of memory") means ``b``
    does not fit. The size doubles from ``start`` until a trial fails on any rank or ``limit``
    is reached, then a binary search between the last size that fitted and the first that did
    not finds the largest that fits: at most ``log2(answer / start) + log2(answer) + 3``
    trials. Without a limit the search grows until memory runs out. After an out-of-memory
    trial on CUDA, every rank collects garbage and empties the allocator's cache.

    A collective: every rank calls it, and every rank returns the same size.

    :raises BatchSizeError: on every rank, when ``start`` does not fit.
    :raises ~ups.core.RankFailedError: on every rank, naming the rank and its exception, when a
        trial fails on some rank for a reason other than memory.
    """
    if start < 1:
        raise ValueError(f"start must be at least 1, not {start}")
    if limit is not None and limit < start:
        raise ValueError(f"limit ({limit}) must be at least start ({start})")
    oom_ranks = _try(ctx, trial, start)
    if oom_ranks:
        raise BatchSizeError(
            f"batch size {start} does not fit: out of memory on rank "
            f"{', '.join(map(str, oom_ranks))}; use a smaller model, a shorter input or "
            "gradient accumulation"
        )
    fits, fails, trials = start, None, 1
    while fails is None and (limit is None or fits < limit):
        size = fits * 2 if limit is None else min(fits * 2, limit)
        trials += 1
        if _try(ctx, trial, size):
            fails = size
        else:
            fits = size
    while fails is not None and fails - fits > 1:
        size = (fits + fails) // 2
        trials += 1
        if _try(ctx, trial, size):
            fails = size
        else:
            fits = size
    if ctx.is_main:
        log.info("largest batch size that fits", batch_size=fits, trials=trials)
    return fits


def _try(ctx: RunContext, trial: Callable[[int], None], size: int) -> list[int]:
    """Run ``trial(size)`` on every rank; return the ranks that ran out of memory (the same
    list on every rank). A collective."""

    def crashed(failures: list[Failure], _error: Exception | None) -> RankFailedError | None:
        """Every rank raises where one failed otherwise than running out of memory."""
        crash = next((f for f in failures if not f.out_of_memory), None)
        return (
            None if crash is None else RankFailedError.naming(f"batch size {size}: {crash}", crash)
        )

    with Agreement(ctx, crashed) as trial_run:  # the trial's error and its frames: dropped
        trial(size)
    oom_ranks = [f.rank for f in trial_run.failures]
    if ctx.is_main:
        log.info("batch size trial", batch_size=size, fits=not oom_ranks, oom_ranks=oom_ranks)
    if oom_ranks and ctx.device.type == "cuda":
        # Free what cycles still hold, then hand the allocator's cached blocks back.
        gc.collect()
        torch.cuda.empty_cache()
    return oom_ranks
