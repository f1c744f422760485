"""The training run: the epoch loop over the parts the config builds.

The parts a newcomer reads alone: :mod:`~ups.core.engine._parts` (what the config builds: model, data,
DDP, optimizer, checkpoint backend), :mod:`~ups.core.engine._step` (the user's step contract),
:mod:`~ups.core.engine._loader` (the data pipeline), :mod:`~ups.core.engine._update` (one optimizer step:
forward, loss, accumulation, AMP, clipping, failures agreed), :mod:`~ups.core.observe._reporter`
(metrics over the ranks), :mod:`~ups.core.engine._resume` (checkpoints saved and resumed). This module
runs the loop, which owns where the run stands.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog
from pluggy import HookRelay
from torch import nn
from torch.utils.data import DataLoader

from ..checkpoint._best import KEY as KEEP_BEST
from ..checkpoint._best import STAGE, admit, keep_best
from ..config._config import Config
from ..config._errors import ConfigError
from ..dist._collectives import all_max, all_range, decide
from ..dist._context import RunContext
from ..dist._desync import check_in_sync
from ..dist._preemption import Preemption
from ..dist._rng import seed_all, set_rng_state
from ..dist._watchdog import Watchdog
from ..observe._logs import rank_log_file
from ..observe._metrics import LossWindow
from ..observe._phases import StepTimer
from ..observe._profiling import StepProfiler, comm_profile, model_counts
from ..observe._reporter import Reporter
from ..observe._step_metrics import UserMetrics
from ..plugin._manager import Registry
from ..plugin._records import TrainResult
from ._ema import EMA, evaluate_beside
from ._evaluation import evaluate, val_named
from ._faults import FaultInjector
from ._guard import FILE as GUARD_FILE
from ._guard import BadStep, Guard, Quarantine, RollingBack
from ._loader import Epoch, StepBatches
from ._model import warm_start
from ._optim import MONITOR, is_plateau, step_on_plateau
from ._parts import Parts, build_parts, run_loader
from ._resume import InStage, Position, Resumed, TrainingState
from ._rundir import RunFiles, own_run_dir
from ._schedule import Schedule, agreed_value, apply_lr_multiplier
from ._snapshot import Snapshot, restore, take
from ._stages import best_model, done_at, keep, kept_weights, runnable, together
from ._step import has_metrics
from ._update import Forward, Stepper

log = structlog.get_logger()


def train_rank(config: Config, ctx: RunContext, registry: Registry) -> TrainResult:
    """Train the configured model on this rank; every rank of the job calls this together
    (:func:`ups.core.train` starts the ranks and calls it on each)."""
    hook = registry.manager.hook
    # The run's folder and this rank's log file stay open for ups_error and ups_run_end too:
    # what a plugin logs there is in logs/rank<r>.jsonl like the rest of the run.
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(own_run_dir(config, ctx))
            held.enter_context(rank_log_file(ctx, config.run_dir))
            if config.stages:
                result = train_stages(config, ctx, registry)
            else:
                result = trained(Run(config, ctx, registry))
        except BaseException as error:
            hook.ups_error(ctx=ctx, error=error)
            raise
        hook.ups_run_end(ctx=ctx, result=result)
    return result


train = train_rank
"""The former name of :func:`train_rank` (``ups.core.engine.train``), kept for code that uses it."""


def trained(run: Run) -> TrainResult:
    """Train ``run``, its ``metrics.jsonl`` closed however it ends."""
    try:
        return run.train()
    finally:
        run.reporter.files.close()


def train_stages(config: Config, ctx: RunContext, registry: Registry) -> TrainResult:
    """Train ``config``'s stages in order on this rank (every rank calls this together): a
    :class:`Run` of each stage's config (:func:`~ups.core.engine._stages.runnable`), numbering
    its steps on from the stage before's; a finished stage's weights kept for the later ones.
    A resume skips the stages done. What the run did, over every stage it trained."""
    RunFiles(config, ctx)  # config.yaml: the whole run's, with its stages
    registry.manager.hook.ups_run_start(ctx=ctx, config=config)
    resumes = config.checkpoint.resume == "latest" or bool(all_max(ctx, ctx.restart_count))
    results: list[TrainResult] = []
    start = 0
    for index, stage in enumerate(config.stages):
        done = (
            decide(ctx, functools.partial(done_at, config.run_dir, stage.name)) if resumes else None
        )
        if done is not None:
            start = done
            continue
        if ctx.is_main:
            log.info(f"stage {index}: {stage.name}", stage=stage.name, start_step=start)
        here = InStage(index=index, name=stage.name, start=start)
        run = Run(runnable(config, index, ctx.device), ctx, registry, here)
        result = trained(run)
        results.append(result)
        if result.preempted:
            break
        best = best_model(run.state.checkpointer, run.state.best) if run.keep_best else None
        weights = kept_weights(run.parts.strategy, run.parts.model, run.ema, best)
        decide(ctx, functools.partial(keep, run.config, weights, here, result.steps))
        start = result.steps
    return together(results, start)


@attrs.frozen
class Stepping:
    """What takes the run's optimizer steps on its parts, and what it counts them into."""

    forward: Forward
    stepper: Stepper
    window: LossWindow
    metrics: UserMetrics
    timer: StepTimer | None
    """Where the steps' time goes (``run.straggler_threshold``), or ``None``."""


def stepping(config: Config, ctx: RunContext, parts: Parts, watchdog: Watchdog) -> Stepping:
    """The forward pass and the stepper over ``parts``, the loss window and the user's metrics
    they count into (the run's, and ``ups tune``'s trial steps)."""
    window = LossWindow(config.data.tasks, ctx.device)
    timer = None if config.run.straggler_threshold is None else StepTimer(ctx.device)
    reduce = config.metrics.reduce if config.metrics is not None else {}
    metrics_key = "metrics.factory" if config.metrics and config.metrics.factory else None
    metrics = UserMetrics(
        reduce,
        window.tasks,
        ctx.device,
        metrics_key or "step.metrics",
        measured=has_metrics(parts.step),
    )
    forward = Forward(
        parts.step,
        ctx,
        config.training.precision,
        metrics,
        watchdog,
        pinned=bool(parts.loader.pin_memory),
        per_task=len(window.tasks) > 1,
    )
    stepper = Stepper(
        ctx=ctx,
        training=config.training,
        model=parts.model,
        ddp=parts.ddp,
        forward=forward,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        watchdog=watchdog,
        even=parts.even,
        strategy=parts.strategy,
        local_passes=parts.local_passes,
        guard=run_guard(config, ctx),
        timer=timer,
    )
    return Stepping(forward, stepper, window, metrics, timer)


class Run:
    """One rank's training run: the parts its config builds (:mod:`~ups.core.engine._parts`), and the
    epoch loop over them, which owns where the run stands (:attr:`position`). :func:`train` is
    how to use it. A stage of a run of several (``stage``) numbers its steps on from its
    start; its ``max_steps``, evaluations, saves, reports, schedule and EMA count its own."""

    def __init__(
        self, config: Config, ctx: RunContext, registry: Registry, stage: InStage | None = None
    ) -> None:
        self.config, self.ctx, self.stage = config, ctx, stage
        self.start = stage.start if stage is not None else 0
        """The step the training starts after (a stage's start; ``0``)."""
        self.hook: HookRelay = registry.manager.hook
        t = config.training
        seed_all(config.run.seed)
        self.schedule = Schedule(
            config.schedule, batch_size=t.batch_size, accumulation_steps=t.accumulation_steps
        )
        self.parts = parts = build_parts(config, ctx, registry, batch_size=self.schedule.batch_size)
        apply_lr_multiplier(parts.optimizer, self.schedule.lr_multiplier, parts.scheduler)
        self.loader = parts.loader
        """The training data's loader, built anew when the schedule changes the batch size."""
        self.restarted = all_max(ctx, ctx.restart_count)
        """How many times the launcher restarted the job (the largest count of any rank: a
        node that joined afresh counts from 0)."""
        self.watchdog = Watchdog(
            ctx, key=str(self.restarted) + (f".{stage.index}" if stage is not None else "")
        )
        steps = stepping(config, ctx, parts, self.watchdog)
        self.forward, self.stepper, self.metrics = steps.forward, steps.stepper, steps.metrics
        self.ema = run_ema(config, parts)
        self.state = self._training_state(self._faults())
        self.reporter = self._reporter(steps)
        profile = config.run.profile_steps
        self.profiler = StepProfiler(ctx, config.run_dir, profile) if profile else None
        self.position = Position(step=self.start, epoch=0)
        self.evaluated_at = -1
        self._grad_norm = float("nan")
        self._location: str | None = None
        self._saved_at = -1
        self.keep_best = keep_best(config.checkpoint.options)
        """``checkpoint.options.keep_best``, or ``None``."""
        self._resumed: Resumed | None = None
        self.snapshot: Snapshot | None = None
        """The guard's latest in-memory snapshot (``training.guard.action: rollback``)."""
        self.quarantine = self._quarantine()
        signals = (signal.Signals[name] for name in config.checkpoint.preempt_signals)
        self.preemption = Preemption(ctx, signals)

    def _quarantine(self) -> Quarantine:
        """The global steps to pass over: those of ``training.guard.quarantine``'s file."""
        quarantine, guard = Quarantine(), self.config.training.guard
        if guard is not None and guard.quarantine is not None:
            quarantine.read(Path(guard.quarantine), "training.guard.quarantine")
        return quarantine

    def _reporter(self, steps: Stepping) -> Reporter:
        """What reports the run's metrics, every ``run.log_every`` steps and at evaluations."""
        flops_per_sample, tokens_per_sample = model_counts(self.parts.model)
        return Reporter(
            self.config,
            self.ctx,
            self.hook,
            RunFiles(self.config, self.ctx, stage=self.stage is not None),
            window=steps.window,
            metrics=steps.metrics,
            flops_per_sample=flops_per_sample,
            tokens_per_sample=tokens_per_sample,
            timer=steps.timer,
        )

    def _faults(self) -> FaultInjector:
        """The faults ``UPS_FAULTS`` injects into this rank (tests of failure paths): checked
        in the model's forward, inside DDP's, after its own collectives."""
        faults = FaultInjector(self.ctx.rank, restart_count=self.restarted)
        if faults:
            stepper, model = self.stepper, self.parts.model
            model.register_forward_pre_hook(lambda *_: faults.check(stepper.attempts))
            model.register_forward_hook(lambda _module, _args, output: faults.corrupt(output))
        return faults

    def _training_state(self, faults: FaultInjector) -> TrainingState:
        """What a checkpoint saves and a resume restores."""
        parts = self.parts
        assert parts.checkpointer is not None  # built to train
        return TrainingState(
            config=self.config,
            ctx=self.ctx,
            hook=self.hook,
            model=parts.model,
            optimizer=parts.optimizer,
            scheduler=parts.scheduler,
            scaler=self.stepper.scaler,
            schedule=self.schedule,
            sampler=parts.sampler,
            dataset=parts.dataset,
            checkpointer=parts.checkpointer,
            comm_state=parts.comm_state,
            strategy=parts.strategy,
            faults=faults,
            ema=self.ema,
            stage=self.stage.index if self.stage is not None else 0,
            guard=self.stepper.guard,
        )

    @property
    def _compared(self) -> nn.Module | None:
        """The model whose parameters the ranks compare, where each holds all of them."""
        return self.parts.model if self.parts.strategy.replicated else None

    @property
    def step(self) -> int:
        """Optimizer steps taken (by the run: a stage's count on from its start)."""
        return self.position.step

    @property
    def own_step(self) -> int:
        """Optimizer steps taken by this training (a stage's own)."""
        return self.position.step - self.start

    def train(self) -> TrainResult:
        """Train: resume if the config or a restart says so, loop until the data,
        ``max_steps``, the schedule or a preemption ends it, then evaluate and save the last
        step; what the run did."""
        if self.stage is None:  # a run of stages starts once (engine._stages)
            self.hook.ups_run_start(ctx=self.ctx, config=self.config)
        self._log_start()
        if self.config.checkpoint.resume == "latest" or self.restarted:
            self._resume()
        if self._resumed is None and self.config.model.init_from is not None:
            warm_start(  # not on resume
                self.parts.model,
                self.config.model.init_from,
                self.ctx,
                place=self.parts.strategy.scattered,
            )
            if self.ema is not None:
                self.ema.reset()  # the average starts from the warm weights
        check_in_sync(self.ctx, self.config.digest(), self.step, self._compared)
        if self._resumed is not None and not self._steps_left():
            return self._complete()
        self.parts.ddp.train()
        self.reporter.restart_clock(self.step)
        with self.watchdog:  # the loop, then the last evaluation and save: a stuck rank is named
            with (
                self.profiler or contextlib.nullcontext(),
                self.reporter.showing_progress(self._total_steps()),
                self.preemption,
            ):
                self._loop()
            preempted = self.preemption.stopped
            self._finish(preempted)
        if preempted:
            self.reporter.files.preempted(self.step)
        return self._result(preempted)

    def _log_start(self) -> None:
        t, ctx = self.config.training, self.ctx
        log.info(
            "training",
            world_size=ctx.world_size,
            backend=ctx.backend,
            device=str(ctx.device),
            samples=len(self.parts.dataset),
            epochs=t.epochs,
            precision=t.precision,
            batch_size=self.schedule.batch_size,
            accumulation_steps=self.schedule.accumulation_steps,
        )

    def _resume(self) -> None:
        """Go on from the newest checkpoint, if there is one: its position, and its
        generators unless the loop restores them where it re-enters the epoch."""
        if self.restarted and self.ctx.is_main:
            log.info("restarted by the launcher: resuming", restarts=self.restarted)
        if self.stepper.guard is not None:  # the bad steps this run recorded before
            self.quarantine.read(self.config.run_dir / GUARD_FILE, "training.guard", own=True)
        self._resumed = self.state.resume()
        if self._resumed is not None:
            self.position = self._resumed.position
            self._saved_at = self.step
            if not self.position.epoch_left:
                set_rng_state(self._resumed.rng, self.ctx.device)

    def _finish(self, preempted: bool) -> None:
        """After the loop: report the steps since the last report, evaluate the last step
        (unless preempted), save it if it is not saved, and wait for the saves."""
        if self.own_step % self.config.run.log_every:
            self.reporter.start(self.step, self.position.epoch, self._extra)
        self.reporter.finish(self.step)
        evaluates = self.parts.eval_loader is not None and not preempted
        best = None
        if evaluates and self.evaluated_at != self.step:
            best = self._admit(val_named(self._evaluate()))
        if self._saved_at != self.step or best:
            self._checkpoint(best)
        assert self.parts.checkpointer is not None  # built to train
        self.parts.checkpointer.wait()

    def _result(self, preempted: bool) -> TrainResult:
        reports = self.reporter.reports
        losses = tuple(r["loss"] for r in reports)
        best = self._best()
        named = {} if best is None else {"best_step": best[0], "best_value": best[1]}
        log.info(
            "done",
            steps=self.step,
            epochs=self.position.epoch,
            loss=round(losses[-1], 6) if losses else None,
            **named,
        )
        return TrainResult(
            steps=self.step,
            epochs=self.position.epoch,
            losses=losses,
            checkpoint=self._location,
            metrics=tuple(reports),
            eval_metrics=tuple(self.reporter.eval_reports),
            preempted=preempted,
            best=best,
        )

    def _best(self) -> tuple[int, float] | None:
        """Keep-best's best checkpoint, ``(step, monitored value)``, or ``None``."""
        return next(iter(self.state.best.items()), None)

    def _steps_left(self) -> bool:
        """Whether the loop has a step to take: ``max_steps``, the schedule and the epochs
        leave one (an epoch resumed mid-way counts as not started)."""
        return self._more_steps() and self.position.epoch < self.config.training.epochs

    def _complete(self) -> TrainResult:
        """A run resumed where it had ended (restarted after its final save, or run again):
        nothing to train, evaluate or save; say so."""
        resumed = self._resumed
        assert resumed is not None
        log.info(f"the run is complete at step {self.step}: nothing left to train", step=self.step)
        return TrainResult(
            steps=self.step,
            epochs=self.position.epoch,
            losses=(),
            checkpoint=resumed.location,
            best=self._best(),
        )

    def _loop(self) -> None:
        """The epochs and their steps, until the data, ``max_steps`` or the schedule ends them."""
        while self._steps_left():
            if self.loader.batch_sampler.batch_size != self.schedule.batch_size:  # type: ignore[union-attr]
                # a scheduled batch size, from this epoch on
                parts = self.parts
                size = self.schedule.batch_size
                self.loader = run_loader(self.config, self.ctx, parts.dataset, parts.sampler, size)
            if hasattr(self.parts.sampler, "set_epoch"):
                self.parts.sampler.set_epoch(self.position.epoch)
            batches = self._enter_epoch()
            left = batches.length
            self._check_as_many(left)
            if self.snapshot is None and self._rolls_back:
                self._take_snapshot()
            rolled = False
            while left and self._more_steps():
                group = min(self.schedule.accumulation_steps, left)
                left -= group
                held = (self.position.epoch, batches.taken + 1)
                if self.quarantine.holds(*held):
                    batches.pass_over(group)
                    self._at(batches, left, taken=False)
                    if self.quarantine.cuts(*held):
                        self._cut_lr()
                    continue
                try:
                    taken = self.stepper.step(self.step + 1, batches, group)
                except BadStep as bad:  # every rank: recorded (a stop raises there), then done
                    record = self._record(bad, batches, group)
                    if isinstance(bad, RollingBack):
                        self._roll_back(record["epoch"], record["batches"][0])
                        rolled = True
                        break
                    taken = None  # skipped
                self._at(batches, left, taken=taken is not None)
                if taken is None:
                    continue  # every rank skipped the batch
                self._grad_norm, micro_batches = taken
                if self.ema is not None:
                    self.ema.update(self.own_step)
                for counted in micro_batches:
                    counted.count(self.reporter.window, self.metrics)
                if self._after_step():
                    return
            if not left and not rolled:
                batches.end()  # a sampler longer than its len() is told of

    @property
    def _rolls_back(self) -> bool:
        guard = self.config.training.guard
        return guard is not None and guard.action == "rollback"

    def _take_snapshot(self) -> None:
        """Copy this rank's training state in memory (:mod:`~ups.core.engine._snapshot`)."""
        guard = self.stepper.guard
        assert guard is not None
        self.snapshot = take(
            self.state, self.position, self.reporter.window, self.metrics, guard.state()
        )

    def _record(self, bad: BadStep, batches: Epoch, group: int) -> dict[str, Any]:
        """Every rank together: record the bad step ``bad`` names, its ``group`` batches (the
        last taken of ``batches``), in ``guard.jsonl``, and hand the record to the
        ``ups_guard_record`` hook (rank 0); a stop raises its error there, on every rank."""
        guard = self.stepper.guard
        assert guard is not None
        first = batches.taken - group + 1
        indices = list(batches.recent)[-group:]
        return guard.record(
            bad,
            self.position.epoch,
            first,
            indices,
            self.config.run_dir,
            lambda record: self.hook.ups_guard_record(ctx=self.ctx, record=record),
        )

    def _roll_back(self, epoch: int, first: int) -> None:
        """Every rank together: quarantine the step whose first batch is ``first`` of epoch
        ``epoch``, restore the snapshot and go on from its position, as a resume does; the
        reports after it superseded in ``metrics.jsonl``."""
        guard, snapshot = self.stepper.guard, self.snapshot
        assert guard is not None and snapshot is not None
        self.quarantine.hold(epoch, first)
        reporter, every = self.reporter, self.config.run.log_every
        reporter.finish(self.step)
        at = snapshot.position.step
        superseded = (self.own_step // every) - ((at - self.start) // every)
        del reporter.reports[len(reporter.reports) - superseded :]
        reporter.files.close()  # metrics.jsonl rewritten below, opened again at its next line
        self.state.supersede_after(at)
        reporter.restart_clock(self.start + (at - self.start) // every * every)
        resumed = restore(self.state, snapshot, reporter.window, self.metrics)
        guard.load_state(snapshot.guard)
        self.position, self._resumed = resumed.position, resumed
        if not resumed.position.epoch_left:
            set_rng_state(resumed.rng, self.ctx.device)

    def _cut_lr(self) -> None:
        """A quarantined step was passed over: cut the LR by ``training.guard.lr_factor`` for
        the next ``lr_steps`` optimizer steps (on top of the schedule's multiplier)."""
        guard = self.stepper.guard
        if guard is None or guard.config.lr_factor == 1:
            return
        guard.cut_left = guard.config.lr_steps
        multiplier = self.schedule.lr_multiplier * guard.config.lr_factor
        apply_lr_multiplier(self.parts.optimizer, multiplier, self.parts.scheduler)

    @property
    def _lr_cut(self) -> float:
        """The guard's LR cut in effect (1 when none)."""
        guard = self.stepper.guard
        return guard.config.lr_factor if guard is not None and guard.cut_left else 1.0

    def _check_as_many(self, batches: int) -> None:
        """Refuse an epoch whose ranks would take other numbers of optimizer steps (every step
        all-reduces across the ranks) or, under a strategy whose every pass gathers from every
        rank (``fsdp``), of ``batches``: a rank with fewer would stop while the others wait
        in a collective, or meet another one. One all-reduce of two numbers, once an epoch.

        :raises ConfigError: on every rank, naming ``sampler.name``.
        """
        if not self.ctx.distributed:
            return
        count, what = math.ceil(batches / self.schedule.accumulation_steps), "optimizer steps"
        why = "every step all-reduces across the ranks"
        if not self.parts.local_passes:
            count, what = batches, "batches"
            why = f"under strategy {self.config.strategy.name!r} each pass gathers parameters"
        least, most = all_range(self.ctx, count)
        if most != least:
            raise ConfigError(
                "sampler.name",
                f"{self.config.sampler.name!r} gives the ranks from {least} to {most} {what} in "
                f"epoch {self.position.epoch}; every rank must take as many ({why}): use a "
                "sampler that deals the ranks evenly (torch, tensor, multitask)",
            )

    def _enter_epoch(self) -> Epoch:
        """Start the next epoch's pass over the loader; after a resume mid-epoch, go on where
        it stopped: from the sampler's state, or skipping the taken batches unread. Then the
        generators as they were."""
        batches = self.loader.batch_sampler
        assert isinstance(batches, StepBatches)
        epoch = self.position.epoch
        resumed, self._resumed = self._resumed, None
        taken = resumed.position.epoch_taken if resumed and resumed.position.epoch_left else 0
        if resumed is not None and resumed.replay:
            batches.start(epoch, skip=taken)
        else:
            batches.start(epoch, first=taken)
        passing = Epoch(self.loader, keep=self.schedule.accumulation_steps)
        if resumed is not None and resumed.position.epoch_left:
            set_rng_state(resumed.rng, self.ctx.device)
        self.position = attrs.evolve(
            self.position, epoch=epoch + 1, epoch_left=passing.length, epoch_taken=passing.taken
        )
        return passing

    def _at(self, batches: Epoch, left: int, *, taken: bool) -> None:
        """Note where the run stands after a step (``taken``: one more optimizer step, else
        skipped): batches of the epoch left and taken, the sampler's state as of the last
        batch taken."""
        self.position = Position(  # not attrs.evolve: a third of the cost, at every step
            step=self.step + taken,
            epoch=self.position.epoch,
            epoch_left=left,
            epoch_taken=batches.taken,
            sampler=batches.sampler_state,
        )

    def _after_step(self) -> bool:
        """Report, profile, evaluate, decide, checkpoint and check, as the config says at this
        step; whether a preemption stops the run here."""
        ctx, reporter = self.ctx, self.reporter
        reporter.step_taken(self.step)
        own = self.own_step
        guard = self.stepper.guard
        if guard is not None and guard.cut_left:
            guard.cut_left -= 1
            if not guard.cut_left:  # the cut is over
                multiplier = self.schedule.lr_multiplier
                apply_lr_multiplier(self.parts.optimizer, multiplier, self.parts.scheduler)
        if own % self.config.run.log_every == 0:
            reporter.start(self.step, self.position.epoch, self._extra)
        if self.profiler is not None:
            self._profile_step(self.profiler)
        evaluated = self._maybe_evaluate()
        values = None if evaluated is None else val_named(evaluated)
        scheduler = self.parts.scheduler
        if values is not None and scheduler is not None and is_plateau(scheduler):
            monitor = self.config.training.scheduler_options.get(MONITOR, "val_loss")
            step_on_plateau(ctx, scheduler, values, monitor)
        decision = self.schedule.decide(
            ctx, own, None if evaluated is None else evaluated["loss"], metrics=values
        )
        if decision is not None and decision.lr_multiplier is not None:
            multiplier = decision.lr_multiplier * self._lr_cut
            apply_lr_multiplier(self.parts.optimizer, multiplier, self.parts.scheduler)
        best = self._admit(values)
        every = self.config.checkpoint.every_steps
        saving = (every and own % every == 0) or (decision and decision.save) or best
        if saving:
            self._checkpoint(best)
        rolling = self.config.training.guard
        if self._rolls_back and rolling and (saving or own % rolling.snapshot_every == 0):
            self._take_snapshot()  # at each save too: a replay saves no step saved before
        check = self.config.distributed.desync_check_every
        if check and own % check == 0:
            check_in_sync(ctx, self.config.digest(), self.step, self._compared)
        if self.preemption.agreed():
            log.warning("preempted: saving and stopping", step=self.step)
            return True
        return False

    def _extra(self, steps: int) -> dict[str, float]:
        """What a report knows at its step besides the aggregated window (``steps``: since
        the report before)."""
        extra = {
            "lr": self.stepper.optimizer.param_groups[0]["lr"],
            "oom_skipped": self.stepper.oom_skipped,
        }
        guard = self.stepper.guard
        if guard is not None:
            extra["guard_skipped"] = guard.skipped
            if guard.config.action == "rollback":
                extra["guard_rollbacks"] = guard.rollbacks
            if guard.scaled:
                extra["scaler_skipped"] = guard.overflows
        extra |= self.parts.comm.metrics(steps)
        if not math.isnan(self._grad_norm):
            extra["grad_norm"] = self._grad_norm
        return extra

    def _checkpoint(self, best: dict[str, float] | None = None) -> None:
        """Save this step (for ``best``: keep-best's monitored value, as :meth:`_admit` gives
        it); a new best is written to ``metrics.jsonl``, where ``ups report`` names it. A
        later stage with keep-best records its stage with every save (keep-best ranks each
        stage's own checkpoints: :mod:`~ups.core.checkpoint._best`)."""
        self.reporter.check_finite(self.step)
        recorded = best
        if self.keep_best is not None and self.stage is not None and self.stage.index:
            recorded = {**(best or {}), STAGE: float(self.stage.index)}
        self._location, self._saved_at = self.state.save(self.position, recorded), self.step
        if best is not None and next(iter(self.state.best)) == self.step:
            self.reporter.files.metrics("best", self.step, best)
            log.info("best checkpoint", step=self.step, location=self._location, **best)

    def _admit(self, values: dict[str, float] | None) -> dict[str, float] | None:
        """With keep-best, after an evaluation (``values``: its values, by their ``val_``
        names): whether its monitored value (rank 0's, on every rank) enters the best kept,
        as ``{monitor: value}`` for the checkpoint to record, the kept set updated; else
        ``None``."""
        keep = self.keep_best
        if keep is None or values is None:
            return None
        value = agreed_value(self.ctx, values, keep.monitor, f"{KEEP_BEST}.monitor")
        kept = admit(self.state.best, self.step, value, keep)
        if kept is None:
            return None
        self.state.best.clear()
        self.state.best.update(kept)
        return {keep.monitor: value}

    def _maybe_evaluate(self) -> dict[str, float] | None:
        """Evaluate if this step is an evaluation step; return the metrics (the same on every
        rank), or ``None``. Whether to evaluate depends on the step alone: every rank agrees."""
        every = self.config.eval.every_steps if self.config.eval else None
        if every and self.own_step % every == 0:
            return self._evaluate()
        return None

    def _evaluate(self) -> dict[str, float]:
        loader = self.parts.eval_loader
        assert loader is not None
        shards = loader.batch_sampler.sampler  # type: ignore[union-attr]
        if hasattr(shards, "set_epoch"):  # a new order each evaluation, for one that shuffles
            shards.set_epoch(len(self.reporter.eval_reports))
        reduce = self.config.metrics.reduce if self.config.metrics else {}
        tasks, which = self.config.data.tasks, self.config.training.ema
        metrics = evaluate_beside(
            self.ema,
            which.evaluate if which is not None else "live",
            lambda: self._evaluate_model(loader, tasks, reduce),
        )
        self.evaluated_at = self.step
        self.reporter.evaluated(self.step, metrics)
        return metrics

    def _evaluate_model(
        self, loader: DataLoader[Any], tasks: Sequence[str], reduce: Mapping[str, str]
    ) -> dict[str, float]:
        """Evaluate the model as it stands on ``loader``, under the strategy's evaluation."""
        model = self.parts.model
        with self.parts.strategy.evaluating(model):
            return evaluate(model, loader, self.forward, tasks, reduce)

    def _more_steps(self) -> bool:
        max_steps = self.config.training.max_steps
        return not self.schedule.stopped and (max_steps is None or self.own_step < max_steps)

    def _total_steps(self) -> int:
        """The optimizer steps the run will take, as the config stands (for the progress bar)."""
        per_epoch = math.ceil(len(self.loader) / self.schedule.accumulation_steps)
        total = per_epoch * self.config.training.epochs
        return self.start + min(total, self.config.training.max_steps or total)

    def _profile_step(self, profiler: StepProfiler) -> None:
        """Tell the profiler a step ended; when its trace is written, measure the
        communication profile (every rank reaches this at the same step)."""
        profiler.step()
        if profiler.trace is None:
            return
        self.profiler = None
        batch = sample_batch(self.parts.dataset, self.loader.collate_fn, self.schedule.batch_size)

        def step(sync: bool) -> None:
            self.stepper.backward_alone(batch, sync=sync)
            self.stepper.optimizer.zero_grad(set_to_none=True)

        profile = comm_profile(self.ctx, step)
        log.info("communication profile", trace=str(profiler.trace), **profile.summary())
        if self.ctx.is_main:
            (profiler.trace.parent / "comm.json").write_text(json.dumps(profile.as_dict()))


def run_guard(config: Config, ctx: RunContext) -> Guard | None:
    """The guard ``training.guard`` asks for, or ``None``."""
    guard = config.training.guard
    if guard is None:
        return None
    fp16 = config.training.precision == "fp16"
    return Guard(guard, ctx, tasks=config.data.tasks, scaled=fp16)


def run_ema(config: Config, parts: Parts) -> EMA | None:
    """The EMA of the model's weights ``training.ema`` asks for, or ``None``."""
    ema = config.training.ema
    if ema is None:
        return None
    return EMA(
        parts.model,
        ema.decay,
        every_steps=ema.every_steps,
        start_step=ema.start_step,
        warmup=ema.warmup,
    )


def sample_batch(dataset: Any, collate: Callable[[list[Any]], Any], size: int) -> Any:
    """A batch of ``dataset``'s first ``size`` samples (repeated if it has fewer), collated by
    ``collate`` (the loader's), for steps outside the loop: profiles and ``ups tune``'s."""
    return collate([dataset[i % len(dataset)] for i in range(size)])
