"""What a plugin logs from ``ups_run_end`` and ``ups_error`` is in the rank's log file
(``logs/rank<r>.jsonl``), with the rank, like everything the run logged before."""

from __future__ import annotations

from pathlib import Path

import structlog

from ups.core import RunContext, TrainResult, hookimpl, load_config, load_plugins
from ups.core.engine import train_rank
from ups.core.testing import events, run_ranks, tiny_project

NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
log = structlog.get_logger()


class Logger:
    """Logs at the run's end and at its error; fails the first report when ``fail``."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    @hookimpl
    def ups_step_end(self, step: int) -> None:
        if self.fail:
            raise RuntimeError("the plugin failed")

    @hookimpl
    def ups_run_end(self, ctx: RunContext, result: TrainResult) -> None:
        log.info("plugin: run ended", steps=result.steps)

    @hookimpl
    def ups_error(self, ctx: RunContext, error: BaseException) -> None:
        log.info("plugin: run failed", error=str(error))


def _train(ctx: RunContext, config: Path, fail: bool) -> str:
    registry = load_plugins(extra=[("logger", Logger(fail))], env=NO_AUTOLOAD)
    try:
        train_rank(load_config(config), ctx, registry)
    except RuntimeError as error:
        return str(error)
    return "ok"


def test_a_plugins_events_at_the_runs_end_are_in_each_ranks_file(tmp_path: Path) -> None:
    assert run_ranks(_train, 2, tiny_project(tmp_path), False) == ["ok", "ok"]
    for rank in (0, 1):
        log = tmp_path / "runs" / "tiny" / "logs" / f"rank{rank}.jsonl"
        [ended] = events(log, "plugin: run ended")
        assert (ended["rank"], ended["level"], ended["steps"]) == (rank, "info", 4)


def test_a_plugins_events_at_the_runs_error_are_in_each_ranks_file(tmp_path: Path) -> None:
    failed = run_ranks(_train, 2, tiny_project(tmp_path), True)
    assert failed == ["the plugin failed"] * 2
    for rank in (0, 1):
        log = tmp_path / "runs" / "tiny" / "logs" / f"rank{rank}.jsonl"
        [said] = events(log, "plugin: run failed")
        assert (said["rank"], said["error"]) == (rank, "the plugin failed")
        [last] = events(log, "failed")  # the rank's own record of the error, after it
        assert "the plugin failed" in last["error"]
