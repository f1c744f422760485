"""What a failed launch says: one line per distinct error, the cause first, the same rank
named whichever rank exited first (:func:`ups.core.rank_failures`), from the error files
torch's agent reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ups.core import rank_failures
from ups.core.cli._common import failed as report_failure

CAUSE = "ConfigError: training.optimizer: unknown 'adamm'"


def failed(folder: Path, said: dict[int, tuple[str, float]]) -> ChildFailedError:
    """A failed launch whose ranks wrote ``said`` (message, timestamp) to their error files,
    as torch's ``record`` does; a rank with no message exited by a signal without one."""
    failures = {}
    for rank, (message, timestamp) in said.items():
        error_file = folder / f"error{rank}.json"
        if message:
            data = {"message": {"message": message, "extraInfo": {"timestamp": int(timestamp)}}}
            error_file.write_text(json.dumps(data))
            os.utime(error_file, (timestamp, timestamp))  # written then
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
def test_ranks_repeating_another_ranks_error_are_left_out(
    tmp_path_factory: object, cause_at: int, echo_at: int, cause_rank: int
) -> None:
    folder = tmp_path_factory.mktemp("e")  # type: ignore[attr-defined]
    cause = f"RuntimeError: disk on fire (rank {cause_rank})"
    said = {
        r: (f"RankFailedError: step 3: rank {cause_rank}: {cause}", 100 + echo_at) for r in range(3)
    }
    said[cause_rank] = (cause, 100 + cause_at)
    assert rank_failures(failed(folder, said)) == [(cause_rank, cause)]


def test_a_rank_naming_another_comes_after_that_ranks_own_error(tmp_path: Path) -> None:
    stopped = "RankFailedError: rank 1 stopped answering: 30 s since its last step"
    cause = "OSError: [Errno 5] Input/output error"
    error = failed(tmp_path, {0: (stopped, 100), 1: (cause, 101), 2: (stopped, 100)})
    assert rank_failures(error) == [(1, cause), (0, stopped)]


def test_a_rank_without_an_error_file_says_how_it_ended(tmp_path: Path) -> None:
    error = failed(tmp_path, {0: (CAUSE, 100), 1: ("", 0)})
    assert rank_failures(error) == [(0, CAUSE), (1, "Signal 15 (SIGTERM) received by PID 1001")]


def test_the_first_error_written_comes_first_within_a_second(tmp_path: Path) -> None:
    # torch's agent keeps whole seconds: both say 100; the files say which came first
    late, early = "OSError: broken pipe", "RuntimeError: injected error"
    error = failed(tmp_path, {0: (late, 100.7), 1: (early, 100.2)})
    assert rank_failures(error) == [(1, early), (0, late)]


def test_a_refusal_naming_a_stopped_ranks_error_prints_that_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 exited 2 repeating rank 0's bad-input error, and the launcher stopped rank 0
    (SIGTERM) after it had written that error: ``ups`` says rank 0's error, once, exit 2 (it
    said nothing when it kept only the messages of the ranks that exited 2)."""
    said = {0: CAUSE, 1: f"RankUsageError: rank 0 failed: {CAUSE}"}
    failures = {}
    for rank, message in said.items():
        error_file = tmp_path / f"error{rank}.json"
        data = {"message": {"message": message, "extraInfo": {"timestamp": 100}}}
        error_file.write_text(json.dumps(data))
        failures[rank] = ProcessFailure(rank, 1000 + rank, -15 if rank == 0 else 2, str(error_file))
    assert report_failure(ChildFailedError("ups", failures)) == 2
    assert capsys.readouterr().err.splitlines() == [f"ups: rank 0 failed: {CAUSE}"]
