"""The straggler report (``run.straggler_threshold``) on real gloo ranks: each rank's step time
by phase, gathered in the report's own all-reduce; a rank made slow in its forward pass
(``UPS_FAULTS=slow@1:1``) is named with its phase in rank 0's log, in ``metrics.jsonl`` and by
``ups report``; a balanced run names none; the timing adds no collective."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ups.core import RunContext, load_config, load_plugins
from ups.core.engine import train_rank
from ups.core.engine._faults import ENV, SLOW_S
from ups.core.observe._phases import FORWARD, OPTIMIZER, PHASES, StepTimer, straggler
from ups.core.testing import counting_all_reduces, events, run_ranks, run_ups, tiny_project

THRESHOLD = 0.5
"""Robust on a busy 2-core machine: with 2 ranks the median is their mean, so a rank is named
only when its time outside communication is 3 times the other's."""


def trained(ctx: RunContext, config_path: Path) -> int:
    """Train on this rank; the all-reduces the engine called."""
    with counting_all_reduces() as calls:
        train_rank(load_config(config_path), ctx, load_plugins())
    return calls[0]


def project(folder: Path, threshold: float | None = THRESHOLD) -> Path:
    """The tiny project on 2 ranks (4 steps an epoch) for 2 epochs, reporting every 2 steps."""
    return tiny_project(
        folder,
        run={"log_every": 2, "straggler_threshold": threshold},
        training={"epochs": 2},
    )


def phase_lines(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "phases"]


def test_the_straggler_is_the_rank_far_above_the_median_and_its_phase_the_largest_excess() -> None:
    fast = [0.001, 0.002, 0.010, 0.001, 0.0]
    slow = [0.001, 0.052, 0.001, 0.001, 0.009]  # backward and collectives: waits, not counted
    named = straggler([fast, slow, fast], 0.2)
    assert named is not None
    assert (named.rank, named.phase) == (1, "forward")
    assert named.seconds == pytest.approx(0.054) and named.median == pytest.approx(0.004)
    assert straggler([fast, fast], 0.2) is None
    assert straggler([slow], 0.2) is None  # one rank: no median to exceed
    assert straggler([fast, [*fast[:3], 0.0025, 0.0]], 0.2) is None  # 12.5% above: within


def test_a_timer_counts_the_time_between_boundaries_to_the_phase_entered() -> None:
    timer = StepTimer(pytest.importorskip("torch").device("cpu"))
    timer.enter(FORWARD)
    time.sleep(0.02)
    timer.enter(OPTIMIZER)
    timer.stop()
    time.sleep(0.02)  # between steps: not counted
    sums = timer.take()
    assert len(sums) == len(PHASES)
    assert 0.02 <= sums[FORWARD] < 0.2 and sums[OPTIMIZER] < 0.01
    assert timer.take() == [0.0] * len(PHASES)


@pytest.mark.slow
def test_a_slow_rank_is_named_with_its_phase_in_the_log_the_metrics_and_ups_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "slow@1:1")
    config = project(tmp_path)
    run_ranks(trained, 2, config)
    run_dir = tmp_path / "runs" / "tiny"
    said = events(run_dir / "logs" / "rank0.jsonl", "straggler")
    # named once it stands out at two reports in a row: from the second report on
    assert [(e["step"], e["slow_rank"], e["phase"]) for e in said] == [
        (step, 1, "forward") for step in (4, 6, 8)
    ]
    assert all(e["rank"] == 0 and e["step_ms"] >= 1000 * SLOW_S > e["median_ms"] for e in said)
    lines = phase_lines(run_dir)
    assert [line["step"] for line in lines] == [2, 4, 6, 8]
    assert "straggler" not in lines[0]
    for line in lines:
        assert line["phases"] == list(PHASES)
        forward = [row[FORWARD] for row in line["ranks"]]
        assert forward[1] >= SLOW_S > forward[0]
    for line in lines[1:]:
        assert (line["straggler"], line["straggler_phase"]) == (1, "forward")
    report = run_ups("report", str(run_dir), "--output", str(tmp_path / "r.png"))
    assert report.returncode == 0, report.stderr
    assert "rank 1 (forward) in 3 of 4 reports" in report.stdout
    rank1 = next(line for line in report.stdout.splitlines() if line.strip().startswith("rank 1"))
    assert "forward" in rank1 and "data" in rank1 and "collectives" in rank1


@pytest.mark.slow
def test_a_balanced_run_names_no_straggler_and_the_timing_adds_no_collective(
    tmp_path: Path,
) -> None:
    on = run_ranks(trained, 2, project(tmp_path / "on"))
    off = run_ranks(trained, 2, project(tmp_path / "off", None))
    assert on == off  # the rows ride the report's own all-reduce
    run_dir = tmp_path / "on" / "runs" / "tiny"
    assert events(run_dir / "logs" / "rank0.jsonl", "straggler") == []
    lines = phase_lines(run_dir)
    assert len(lines) == 4
    for line in lines:
        assert "straggler" not in line
        assert len(line["ranks"]) == 2
        assert all(r[FORWARD] > 0 and min(r) >= 0 for r in line["ranks"])
    assert phase_lines(tmp_path / "off" / "runs" / "tiny") == []
