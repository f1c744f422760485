"""Reporting: every ``run.log_every`` steps, the metrics aggregated over all ranks, logged by
rank 0, handed to the plugins and written to the run's files.

A report is started at its step (the all-reduces launched, not waited for) and finished one
step later, so no rank waits on the others or on rank 0's logging before its next step.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator

import attrs
import structlog
from pluggy import HookRelay

from ..config._config import Config
from ..dist._collectives import all_max
from ..dist._context import RunContext
from ..engine._rundir import RunFiles
from ..engine._step import StepError
from ._logs import to_file
from ._metrics import LossWindow, PendingReport
from ._phases import PHASES, StepTimer, own_row, straggler
from ._profiling import throughput
from ._progress import Progress
from ._step_metrics import PendingMetrics, UserMetrics

log = structlog.get_logger()


@attrs.frozen(kw_only=True)
class _Report:
    """A report on its way: what is known at its step, and the all-reduces still running."""

    step: int
    epoch: int
    extra: dict[str, float]
    losses: PendingReport
    user: PendingMetrics
    steps: int
    """Optimizer steps since the report before."""
    seconds: float
    """Wall time since the report before (this rank's)."""


class Reporter:
    """Starts and finishes the training reports, and records evaluations."""

    def __init__(
        self,
        config: Config,
        ctx: RunContext,
        hook: HookRelay,
        files: RunFiles,
        *,
        window: LossWindow,
        metrics: UserMetrics,
        flops_per_sample: float | None,
        tokens_per_sample: float | None,
        timer: StepTimer | None = None,
    ) -> None:
        self.config, self.ctx, self.hook, self.files = config, ctx, hook, files
        self.timer = timer
        """Each rank's time per phase of its steps (:mod:`~ups.core.observe._phases`), summed
        in each report's all-reduce; ``None``: not timed."""
        self._suspect: int | None = None
        """The rank that stood out at the report before: named if it stands out again."""
        self.window, self.metrics = window, metrics
        self._counts = (flops_per_sample, tokens_per_sample)
        self.reports: list[dict[str, float]] = []
        self.eval_reports: list[dict[str, float]] = []
        self.progress = Progress(ctx, None, enabled=False)
        self._pending: _Report | None = None
        self._reported_at = (0, time.perf_counter())

    @contextlib.contextmanager
    def showing_progress(self, total: int) -> Iterator[None]:
        """Show a progress bar of ``total`` steps while inside (rank 0, on a terminal). The
        reports after it (the run's last) still go where the bar's would: on a terminal, the
        full record to the rank's log file alone."""
        with Progress(self.ctx, total) as bar:
            self.progress = bar
            yield

    def step_taken(self, step: int) -> None:
        """The run took optimizer step ``step``: the bar moves, and the report started at the
        step before is finished."""
        self.progress.update(step)
        self.finish(step)

    def restart_clock(self, step: int) -> None:
        """Count the next report's steps and time from ``step``, now."""
        self._reported_at = (step, time.perf_counter())

    def start(self, step: int, epoch: int, extra: Callable[[int], dict[str, float]]) -> None:
        """Start the report of ``step`` (finishing the one before): the window's aggregation
        over the ranks is launched; ``extra(steps since the report before)`` gives metrics
        known already. Nothing to report when no step was taken since the report before. A
        collective."""
        self.finish(step)
        last_step, last_time = self._reported_at
        if step == last_step:
            return
        self._reported_at = (step, time.perf_counter())
        ctx, timer = self.ctx, self.timer
        rows = None if timer is None else own_row(timer, ctx.rank, ctx.world_size, ctx.device)
        self._pending = _Report(
            step=step,
            epoch=epoch,
            extra=extra(step - last_step),
            losses=self.window.report(ctx, rows),
            user=self.metrics.report(self.ctx),
            steps=step - last_step,
            seconds=self._reported_at[1] - last_time,
        )

    def finish(self, now: int) -> None:
        """Log and hand on the report started at an earlier step, if any (``now``: the step
        the run is at, for the progress bar).

        :raises StepError: on every rank, when the losses of the report were not finite.
        """
        report, self._pending = self._pending, None
        if report is None:
            return
        metrics = report.losses.result()
        if not math.isfinite(metrics["loss"]):
            raise StepError(
                f"step.loss: the loss was {metrics['loss']} in the steps up to {report.step} "
                f"(since step {report.step - report.steps}); expected finite losses: lower "
                "training.lr, clip gradients (training.grad_clip_norm), or check the data"
            )
        metrics |= report.user.result()
        metrics |= report.extra
        metrics |= throughput(
            metrics["samples"],
            report.seconds,
            world_size=self.ctx.world_size,
            flops_per_sample=self._counts[0],
            tokens_per_sample=self._counts[1],
            peak_flops=self.config.training.peak_flops,
        )
        metrics["step_time_s"] = report.seconds / report.steps
        step = report.step
        self.progress.update(now, metrics)
        # A person watching the bar reads the few numbers it shows; the full record goes to the
        # rank's log file (and metrics.jsonl), as it goes to the console without a bar.
        record = functools.partial(to_file, "info") if self.progress.on_terminal else log.info
        record("step", step=step, epoch=report.epoch, **{k: _round(v) for k, v in metrics.items()})
        self.hook.ups_step_end(ctx=self.ctx, step=step, metrics=metrics)
        self.files.metrics("train", step, metrics)
        self.reports.append(metrics)
        if report.losses.also:
            self._phases(step, report.losses.also, report.steps)

    def _phases(self, step: int, sums: list[float], steps: int) -> None:
        """Record each rank's seconds per step in each phase (a ``phases`` line of
        ``metrics.jsonl``) and name the straggler, if any (a ``straggler`` warning): a rank
        that stands out at two reports in a row (one report's noise names none)."""
        width = len(PHASES)
        rows = [[s / steps for s in sums[r : r + width]] for r in range(0, len(sums), width)]
        threshold = self.config.run.straggler_threshold
        slow = None if threshold is None else straggler(rows, threshold)
        suspect, self._suspect = self._suspect, None if slow is None else slow.rank
        if slow is not None and slow.rank != suspect:
            slow = None
        if slow is not None and self.ctx.is_main:
            log.warning(
                "straggler",
                step=step,
                slow_rank=slow.rank,
                phase=slow.phase,
                step_ms=round(slow.seconds * 1000, 3),
                median_ms=round(slow.median * 1000, 3),
            )
        record = {"phases": list(PHASES), "ranks": [[_round(s) for s in row] for row in rows]}
        if slow is not None:
            record |= {"straggler": slow.rank, "straggler_phase": slow.phase}
        self.files.metrics("phases", step, record)

    def check_finite(self, step: int) -> None:
        """Before a checkpoint: finish the report on its way and check, over every rank, that
        the losses since it are finite, so that no checkpoint holds a diverged model.

        :raises StepError: on every rank, when one saw a loss that is not finite.
        """
        self.finish(step)
        if all_max(self.ctx, int(not self.window.finite())):
            raise StepError(
                f"step.loss: a loss that is not finite before step {step}; expected finite "
                "losses: lower training.lr, clip gradients (training.grad_clip_norm), or "
                "check the data (the checkpoint of this step was not saved)"
            )

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """Log and hand on an evaluation's metrics."""
        log.info("eval", step=step, **{f"val_{k}": _round(v) for k, v in metrics.items()})
        self.progress.update(step, {"val_loss": metrics["loss"]})
        self.hook.ups_eval_end(ctx=self.ctx, step=step, metrics=metrics)
        self.files.metrics("eval", step, metrics)
        self.eval_reports.append(metrics)


def _round(value: float) -> float:
    return round(value, 6) if isinstance(value, float) else value
