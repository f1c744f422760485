"""What a failed launch says: one line per distinct error, the cause first, the same rank
named whichever rank exited first (:func:`ups.core.rank_failures`), from the error files
torch's agent reads."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ups.core import rank_failures

CAUSE = "ConfigError: training.optimizer: unknown 'adamm'"


def failed(folder: Path, said: dict[int, tuple[str, int]]) -> ChildFailedError:
    """A failed launch whose ranks wrote ``said`` (message, timestamp) to their error files,
    as torch's ``record`` does; a rank with no message exited by a signal without one."""
    failures = {}
    for rank, (message, timestamp) in said.items():
        error_file = folder / f"error{rank}.json"
        if message:
            data = {"message": {"message": message, "extraInfo": {"timestamp": timestamp}}}
            error_file.write_text(json.dumps(data))
        failures[rank] = ProcessFailure(
            rank, 1000 + rank, -15 if not message else 1, str(error_file)
        )
    return ChildFailedError("ups", failures)


@settings(max_examples=50, deadline=None)
@given(times=st.lists(st.integers(0, 3), min_size=2, max_size=6))
def test_ranks_failing_alike_are_one_line_naming_the_lowest_rank(
    tmp_path_factory: object, times: list[int]
) -> None:
    folder = tmp_path_factory.mktemp("e")  # type: ignore[attr-defined]
    error = failed(folder, {rank: (CAUSE, 100 + t) for rank, t in enumerate(times)})
    assert rank_failures(error) == [(0, CAUSE)]


@settings(max_examples=50, deadline=None)
@given(cause_at=st.integers(0, 3), echo_at=st.integers(0, 3), cause_rank=st.integers(0, 2))
def test_the_cause_comes_before_the_ranks_that_repeat_it(
    tmp_path_factory: object, cause_at: int, echo_at: int, cause_rank: int
) -> None:
    folder = tmp_path_factory.mktemp("e")  # type: ignore[attr-defined]
    cause = f"RuntimeError: disk on fire (rank {cause_rank})"
    echo = f"RankFailedError: step 3: rank {cause_rank}: {cause}"
    said = {r: (echo, 100 + echo_at) for r in range(3)}
    said[cause_rank] = (cause, 100 + cause_at)
    assert rank_failures(failed(folder, said)) == [
        (cause_rank, cause),
        (min(set(range(3)) - {cause_rank}), echo),
    ]


def test_a_rank_without_an_error_file_says_how_it_ended(tmp_path: Path) -> None:
    error = failed(tmp_path, {0: (CAUSE, 100), 1: ("", 0)})
    assert rank_failures(error) == [(0, CAUSE), (1, "Signal 15 (SIGTERM) received by PID 1001")]
