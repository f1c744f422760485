"""User metrics on real ranks: reduced over batches and ranks as declared; ranks that report
different names get an error on every rank instead of a deadlock."""

from __future__ import annotations

from pathlib import Path

import pytest

from ups.core import ConfigError, RunContext, Step, load_config, load_plugins, train
from ups.core.engine import train_rank
from ups.core.engine._step import has_metrics
from ups.core.observe._step_metrics import UserMetrics
from ups.core.testing import counting_all_reduces, run_ranks, tiny_project

METRICS_MODULE = """
import os


def build(extra_on_rank=None):
    rank = float(os.environ.get("RANK", "0"))

    def metrics(outputs, targets):
        values = {
            "rank_mean": rank,
            "rank_sum": rank,
            "rank_max": rank,
            "samples_seen": len(outputs),
            "mae": (outputs - targets).abs().mean(),
        }
        if extra_on_rank == rank:
            values["extra"] = 1.0
        return values

    return metrics


def not_a_number(outputs, targets):
    return {"vector": outputs}


def build_bad():
    return not_a_number
"""

REDUCE = {"rank_sum": "sum", "rank_max": "max", "samples_seen": "sum", "mae": "mean"}


def project(folder: Path, **options: object) -> Path:
    (folder / "user_metrics.py").write_text(METRICS_MODULE)
    metrics = {"factory": "user_metrics.py:build", "options": options, "reduce": REDUCE}
    return tiny_project(folder, metrics=metrics, run={"log_every": 2})


def outcome(ctx: RunContext, config_path: Path) -> tuple[str, str]:
    try:
        train_rank(load_config(config_path), ctx, load_plugins())
    except Exception as error:
        return type(error).__name__, str(error)
    return "ok", ""


@pytest.mark.slow
def test_metrics_are_reduced_over_batches_and_ranks_as_declared(tmp_path: Path) -> None:
    result = train(project(tmp_path), nproc=2)
    assert result.steps == 4  # 64 samples / 2 ranks / batch 8
    for report in result.metrics:
        # each report: 2 steps x 2 ranks of 8 samples; rank 0 says 0, rank 1 says 1
        assert report["rank_mean"] == 0.5
        assert report["rank_sum"] == 2.0
        assert report["rank_max"] == 1.0
        assert report["samples_seen"] == report["samples"] == 32
        assert 0 < report["mae"] < 10


@pytest.mark.slow
def test_ranks_with_different_metric_names_fail_together_without_a_deadlock(
    tmp_path: Path,
) -> None:
    ends = run_ranks(outcome, 2, project(tmp_path, extra_on_rank=1), timeout_s=30)
    message = (
        "metrics.factory: the ranks report different metric names "
        "(rank 0: mae, rank_max, rank_mean, rank_sum, samples_seen; "
        "rank 1: extra, mae, rank_max, rank_mean, rank_sum, samples_seen); "
        "every rank must return the same names on every batch"
    )
    assert ends == [("MetricNamesError", message)] * 2


def test_a_metric_that_is_not_one_number_is_named(tmp_path: Path) -> None:
    # one process: the rank that failed raises its own error
    config = load_config(project(tmp_path), ["metrics.factory=user_metrics.py:build_bad"])
    with pytest.raises(
        ConfigError,
        match=r"metric .vector. is a tensor of shape \(8, 1\); expected one number, or one per sample",
    ):
        train(config)


def test_a_bad_reduction_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.reduce\.mae: 'median' is not one of"):
        load_config(project(tmp_path), ["metrics.reduce.mae=median"])


def _collectives_per_report(ctx: RunContext, measured: bool) -> int:
    """The ``torch.distributed`` all-reduces of one report of a window without metrics."""
    metrics = UserMetrics({}, ("all",), ctx.device, measured=measured)
    with counting_all_reduces() as calls:
        assert metrics.report(ctx).result() == {}
    return calls[0]


def test_a_step_without_metrics_reports_them_with_no_collective() -> None:
    # the built-in step without metrics.factory has none; one with a function, or a Step of
    # one's own with metrics(), may have some, whose names the ranks compare at each report
    assert not has_metrics(Step())
    assert has_metrics(Step(metric_fn=lambda outputs, targets: {}))
    assert run_ranks(_collectives_per_report, 2, False) == [0, 0]
    assert run_ranks(_collectives_per_report, 2, True) == [1, 1]
