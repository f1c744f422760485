"""``Agreement``: the one "run, catch, gather the failures, raise on every rank" of the engine,
on real 2-rank gloo groups, and what it lets a tolerated failure free."""

from __future__ import annotations

import gc
import weakref

import pytest

from ups.core import Agreement, Failure, RankFailedError, RunContext
from ups.core.testing import run_ranks


def naming(failures: list[Failure], error: Exception | None) -> Exception:
    """A failed rank raises its own error; the others one naming the first rank that failed."""
    return (
        error if error is not None else RankFailedError.naming(f"work: {failures[0]}", failures[0])
    )


def tolerating(failures: list[Failure], error: Exception | None) -> None:
    """Every rank goes on."""


def agree_on(
    ctx: RunContext, failing: list[int], tolerate: bool
) -> tuple[str, list[int], float | None]:
    """What this rank raised (or ``went on``), the failures every rank learnt, and the sum of
    every rank's ``rank + 1``, taken as the block exits."""
    agreed = Agreement(ctx, tolerating if tolerate else naming, summing=lambda: ctx.rank + 1.0)
    outcome = "went on"
    try:
        with agreed:
            if ctx.rank in failing:
                raise OSError(f"rank {ctx.rank} broke")
    except Exception as raised:
        cause = raised.__cause__
        outcome = f"{type(raised).__name__}: {raised}" + (f" (from {cause})" if cause else "")
    total = None if agreed.total is None else float(agreed.total.item())
    return outcome, [f.rank for f in agreed.failures], total


def test_no_rank_failing_every_rank_goes_on_with_the_sum() -> None:
    assert run_ranks(agree_on, 2, [], False) == [("went on", [], 3.0)] * 2


def test_a_rank_failing_every_rank_raises_what_raising_says() -> None:
    [rank0, rank1] = run_ranks(agree_on, 2, [1], False)
    assert rank0 == ("RankFailedError: work: rank 1: OSError: rank 1 broke", [1], 3.0)
    assert rank1 == ("OSError: rank 1 broke", [1], 3.0)  # its own, as it is


def test_every_rank_failing_each_raises_its_own() -> None:
    [rank0, rank1] = run_ranks(agree_on, 2, [0, 1], False)
    assert (rank0[0], rank1[0]) == ("OSError: rank 0 broke", "OSError: rank 1 broke")
    assert rank0[1] == rank1[1] == [0, 1]


def test_a_tolerated_failure_lets_every_rank_go_on_knowing_it() -> None:
    assert run_ranks(agree_on, 2, [0], True) == [("went on", [0], 3.0)] * 2


def test_another_error_is_raised_from_this_rank_s_own() -> None:
    def other(failures: list[Failure], error: Exception | None) -> Exception:
        return RuntimeError(f"{len(failures)} failed")

    with pytest.raises(RuntimeError, match="1 failed") as raised, Agreement(RunContext(), other):
        raise OSError("broke")
    assert isinstance(raised.value.__cause__, OSError)


def test_an_interrupt_passes_without_agreeing() -> None:
    called: list[object] = []

    def raising(failures: list[Failure], error: Exception | None) -> None:
        called.append(error)

    with pytest.raises(KeyboardInterrupt), Agreement(RunContext(), raising):
        raise KeyboardInterrupt
    assert called == []


class Big:
    """Stands for the tensors a failed step's frames hold."""


def test_raising_can_free_what_the_failed_block_s_frames_held() -> None:
    """An out-of-memory step is skipped: ``raising`` drops the error's traceback and empties
    the allocator's cache, which only helps if nothing else holds the frames' tensors."""
    alive: list[bool] = []

    def work() -> None:
        big = Big()
        held.append(weakref.ref(big))
        raise MemoryError("out of memory")

    def skipping(failures: list[Failure], error: Exception | None) -> None:
        assert error is not None
        error.__traceback__ = None
        gc.disable()  # freed by reference counting, at once, not by a later collection
        try:
            alive.append(held[0]() is not None)
        finally:
            gc.enable()

    held: list[weakref.ref[Big]] = []
    with Agreement(RunContext(), skipping):
        work()
    assert alive == [False]
