"""A monitored metric (a plateau rule's, ``ReduceLROnPlateau``'s, ``keep_best``'s) that the
run's evaluation reports only at run time, a user metric, is checked at the first evaluation:
misspelt, every rank stops there with one line naming what the evaluation does report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ups.core.testing import run_ups, tiny_project

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}

METRICS_MODULE = """
def build():
    return lambda outputs, targets: {"mae": (outputs - targets).abs().mean(dim=1)}
"""


@pytest.mark.parametrize(
    ("sections", "key"),
    [
        (
            {"schedule": [{"when": {"plateau": {"monitor": "val_mea"}}, "do": {"stop": True}}]},
            "schedule[0].when.plateau.monitor",
        ),
        (
            {"checkpoint": {"options": {"keep_best": {"monitor": "val_mea"}}}},
            "checkpoint.options.keep_best.monitor",
        ),
    ],
)
def test_a_metric_the_run_never_reports_stops_every_rank_at_the_first_evaluation(
    tmp_path: Path, sections: dict[str, Any], key: str
) -> None:
    config = tiny_project(tmp_path, eval=EVAL, metrics={"factory": "mae.py:build"}, **sections)
    (tmp_path / "mae.py").write_text(METRICS_MODULE)
    assert run_ups("validate", str(config), cwd=tmp_path).returncode == 0  # known at run time only
    result = run_ups("train", str(config), "--nproc", "2", cwd=tmp_path, timeout=240)
    assert result.returncode == 2, result.stderr
    assert (
        f"{key}: 'val_mea' is not reported by the run's evaluation; "
        "it reports: val_loss, val_mae, val_samples; did you mean 'val_mae'?"
    ) in result.stderr
