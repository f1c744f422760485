"""find_batch_size: the search on one process (property tests), and on real 2-rank gloo groups,
where every rank tries the same sizes and returns the same answer."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import RankFailedError, RunContext
from ups.core.engine._largest_batch import BatchSizeError, find_batch_size
from ups.core.testing import run_ranks

OOM_ERRORS: list[Callable[[], Exception]] = [
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: RuntimeError("CUDA error: out of memory"),  # what older CUDA builds raise
]


def fitting_up_to(
    threshold: int, tried: list[int], oom: Callable[[], Exception] = OOM_ERRORS[0]
) -> Callable[[int], None]:
    """A trial that records each size and runs out of memory above ``threshold``."""

    def trial(size: int) -> None:
        tried.append(size)
        if size > threshold:
            raise oom()

    return trial


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(1, 64),
    headroom=st.integers(0, 5000),
    limit_above_start=st.none() | st.integers(0, 8000),
    oom=st.sampled_from(OOM_ERRORS),
)
def test_the_search_finds_the_largest_size_that_fits_in_few_trials(
    start: int, headroom: int, limit_above_start: int | None, oom: Callable[[], Exception]
) -> None:
    threshold = start + headroom
    limit = None if limit_above_start is None else start + limit_above_start
    tried: list[int] = []
    result = find_batch_size(
        RunContext(), fitting_up_to(threshold, tried, oom), start=start, limit=limit
    )
    expected = threshold if limit is None else min(threshold, limit)
    assert result == expected
    assert tried[0] == start
    assert len(set(tried)) == len(tried)  # no size is tried twice
    assert limit is None or max(tried) <= limit
    # Doubling up to the answer, then halving the gap between it and twice it.
    doublings = math.floor(math.log2(expected / start)) + 1
    assert len(tried) <= 1 + doublings + math.ceil(math.log2(expected))


@given(start=st.integers(2, 64), threshold=st.integers(0, 64))
def test_a_start_that_does_not_fit_is_an_error(start: int, threshold: int) -> None:
    threshold = min(threshold, start - 1)
    tried: list[int] = []
    with pytest.raises(BatchSizeError, match=f"^batch size {start} does not fit: .* rank 0;"):
        find_batch_size(RunContext(), fitting_up_to(threshold, tried), start=start)
    assert tried == [start]


def test_each_trial_and_the_result_are_logged() -> None:
    with structlog.testing.capture_logs() as logs:
        find_batch_size(RunContext(), fitting_up_to(5, []), limit=100)
    trials = [(e["batch_size"], e["fits"]) for e in logs if e["event"] == "batch size trial"]
    assert trials == [(1, True), (2, True), (4, True), (8, False), (6, False), (5, True)]
    assert logs[-1] == {
        "event": "largest batch size that fits",
        "log_level": "info",
        "batch_size": 5,
        "trials": 6,
    }


def test_other_errors_are_not_taken_for_running_out_of_memory() -> None:
    def trial(size: int) -> None:
        if size == 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RankFailedError, match="^batch size 4: rank 0: RuntimeError: CUDA error"):
        find_batch_size(RunContext(), trial, limit=64)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="start must be at least 1"):
        find_batch_size(RunContext(), fitting_up_to(8, []), start=0)
    with pytest.raises(ValueError, match=r"limit \(2\) must be at least start \(4\)"):
        find_batch_size(RunContext(), fitting_up_to(8, []), start=4, limit=2)


def search_with_thresholds(ctx: RunContext, thresholds: list[int]) -> tuple[int, list[int]]:
    tried: list[int] = []
    size = find_batch_size(ctx, fitting_up_to(thresholds[ctx.rank], tried), limit=100)
    return size, tried


@pytest.mark.slow
def test_every_rank_tries_the_same_sizes_and_agrees_on_the_smallest_memory() -> None:
    results = run_ranks(search_with_thresholds, 2, [37, 21])
    # Rank 1 runs out at 32, 24 and 22; rank 0 only agrees, it would have fitted them.
    assert results == [(21, [1, 2, 4, 8, 16, 32, 24, 20, 22, 21])] * 2


def fail_on_rank_1(ctx: RunContext) -> tuple[str, str | None]:
    def trial(size: int) -> None:
        if ctx.rank == 1 and size == 4:
            raise ValueError("labels do not match the outputs")

    try:
        find_batch_size(ctx, trial, limit=64)
    except RankFailedError as error:
        return str(error), type(error.__cause__).__name__ if error.__cause__ else None
    return "no error", None


@pytest.mark.slow
def test_an_error_on_one_rank_is_raised_on_every_rank_naming_it() -> None:
    message = "batch size 4: rank 1: ValueError: labels do not match the outputs"
    # Rank 1 keeps its own exception as the cause.
    assert run_ranks(fail_on_rank_1, 2, timeout_s=30) == [(message, None), (message, "ValueError")]


def start_fits_on_rank_0_only(ctx: RunContext) -> str:
    try:
        find_batch_size(ctx, fitting_up_to([8, 2][ctx.rank], []), start=4)
    except BatchSizeError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_a_start_that_does_not_fit_on_one_rank_is_an_error_on_every_rank() -> None:
    messages = run_ranks(start_fits_on_rank_0_only, 2, timeout_s=30)
    assert messages[0] == messages[1]
    assert messages[0].startswith("batch size 4 does not fit: out of memory on rank 1;")
