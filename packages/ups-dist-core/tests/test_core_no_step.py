"""Data that gives no training step, or an evaluation set that is empty, is a usage error
naming its factory (issue 26, item 7), not a run that "succeeds" with 0 steps, a null loss and
a step-0 checkpoint; under ``ups train --nproc 2`` it reaches the console as one line, with
exit status 2."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ups.core.testing import run_ups, tiny_project


def said(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of stderr that are not JSON log records."""
    return [line for line in result.stderr.splitlines() if not line.startswith("{")]


def test_an_empty_training_set_is_refused_naming_data_factory(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, data={"options": {"n": 0}})
    result = run_ups("train", str(config))
    assert result.returncode == 2
    assert said(result) == [
        "ups: error: data.factory: returned 0 samples, of which the 'torch' sampler deals no "
        "batch to this rank (of 1): the run would take no step; allowed: at least 1 sample"
    ]
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()


def test_an_empty_evaluation_set_is_refused_naming_eval_factory(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, eval={"factory": "tiny.py:build_dataset", "options": {"n": 0}})
    result = run_ups("train", str(config))
    assert result.returncode == 2
    assert said(result) == [
        "ups: error: eval.factory: returned 0 samples: nothing to evaluate; allowed: at least "
        "1 sample"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("samples", "drop_last", "allowed"),
    [(0, False, "at least 1 sample"), (1, True, "and 2 (one per rank)")],
)
def test_on_two_ranks_data_that_gives_no_step_is_one_line_and_exit_2(
    tmp_path: Path, samples: int, drop_last: bool, allowed: str
) -> None:
    """An empty set, or 1 sample for 2 ranks with a sampler that drops the rest."""
    config = tiny_project(
        tmp_path,
        data={"options": {"n": samples}},
        sampler={"options": {"drop_last": drop_last}},
    )
    result = run_ups("train", str(config), "--nproc", "2")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = said(result)
    assert len(lines) == 1, result.stderr[-3000:]
    # Both ranks find it; the launcher says whichever exited first.
    assert re.match(
        rf"ups: rank [01] failed: ConfigError: data\.factory: returned {samples} samples, of "
        r"which the 'torch' sampler deals no batch to this rank \(of 2\): the run would take no "
        r"step; ",
        lines[0],
    ), lines[0]
    assert allowed in lines[0]
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()
