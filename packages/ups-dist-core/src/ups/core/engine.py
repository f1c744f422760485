"""The training run: build what the config names, wrap it in DDP, and loop over the epochs.

The parts a newcomer reads alone: :mod:`~ups.core.step` (the user's step contract),
:mod:`~ups.core.loader` (the data pipeline), :mod:`~ups.core.stepping` (one optimizer step:
forward, loss, accumulation, AMP, clipping, failures agreed), :mod:`~ups.core.reporting`
(metrics over the ranks), :mod:`~ups.core.resume` (checkpoints saved and resumed). This module
builds them and runs the epoch loop.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import signal
from typing import Any

import attrs
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .collectives import all_max
from .config import Config
from .context import RunContext
from .desync import check_in_sync
from .errors import ConfigError
from .evaluation import evaluate
from .faults import FaultInjector
from .imports import load_object
from .loader import Epoch, build_dataset, data_loader
from .logs import rank_log_file
from .metrics import LossWindow
from .optim import build_optimizer, build_scheduler
from .plugins import Registry
from .preemption import Preemption
from .profiling import CommCounter, StepProfiler, comm_profile, model_counts
from .progress import Progress
from .records import Checkpointer, TrainResult
from .reporting import Reporter
from .resume import Position, Resumed, TrainingState
from .rng import seed_all, set_rng_state
from .rundir import RunFiles, own_run_dir
from .schedule import Schedule, apply_lr_multiplier
from .step import build_step, has_metrics
from .stepping import Forward, Stepper
from .user_metrics import UserMetrics
from .validate import check_data, check_loader, select_sampler
from .watchdog import Watchdog

log = structlog.get_logger()


def build_model(config: Config) -> nn.Module:
    """Call ``model.factory(**model.options)``; check that it returns a module."""
    model = load_object(config.model.factory, "model.factory")(**config.model.options)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model.factory", f"returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def wrap(model: nn.Module, ctx: RunContext, config: Config) -> nn.Module:
    """Wrap ``model`` in DDP with the config's options (``model`` itself on one process)."""
    if not ctx.distributed:
        return model
    d = config.distributed
    buffers: dict[str, Any] = {}
    if not d.broadcast_buffers:
        # torch >= 2.12 renamed it; the new name still syncs buffers once, at construction.
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        buffers = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
    return DistributedDataParallel(
        model,
        device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=d.bucket_cap_mb,
        static_graph=d.static_graph,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        find_unused_parameters=d.find_unused_parameters,
        **buffers,
    )


def train(config: Config, ctx: RunContext, registry: Registry) -> TrainResult:
    """Train the configured model on this rank; every rank of the job calls this together."""
    hook = registry.manager.hook
    # The run's folder and this rank's log file stay open for ups_error and ups_run_end too:
    # what a plugin logs there is in logs/rank<r>.jsonl like the rest of the run.
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(own_run_dir(config, ctx))
            held.enter_context(rank_log_file(ctx, config.run_dir))
            run = Run(config, ctx, registry)
            try:
                result = run.train()
            finally:
                run.reporter.files.close()
        except BaseException as error:
            hook.ups_error(ctx=ctx, error=error)
            raise
        hook.ups_run_end(ctx=ctx, result=result)
    return result


class Run:
    """One rank's training run: what it built from the config, and the epoch loop over it.
    :func:`train` is how to use it; ``ups tune`` uses :meth:`trial_step`."""

    def __init__(self, config: Config, ctx: RunContext, registry: Registry) -> None:
        self.config, self.ctx, self.hook = config, ctx, registry.manager.hook
        t = config.training
        seed_all(config.run.seed)
        check_loader(config.data.loader)
        self.step_fn = build_step(config)
        self.model = build_model(config).to(ctx.device)
        if ctx.distributed and config.distributed.sync_batchnorm:
            convert = nn.SyncBatchNorm.convert_sync_batchnorm
            self.model = convert(self.model)  # type: ignore[no-untyped-call]
        self.dataset = build_dataset(config.data, "data")
        sampler_plugin, sampler_options = select_sampler(
            registry, config.sampler, "sampler", exact=False
        )
        self.sampler = sampler_plugin.factory(
            self.dataset, ctx=ctx, seed=config.run.seed, options=sampler_options
        )
        self.schedule = Schedule(
            config.schedule, batch_size=t.batch_size, accumulation_steps=t.accumulation_steps
        )
        self.loader = self._loader(self.dataset, self.sampler, self.schedule.batch_size)
        self.eval_loader = None
        if config.eval is not None:
            eval_set = build_dataset(config.eval, "eval")
            plugin, options = select_sampler(
                registry, config.eval.sampler, "eval.sampler", exact=True
            )
            shards = plugin.factory(eval_set, ctx=ctx, seed=config.run.seed, options=options)
            # Its workers are kept between evaluations: an evaluation set does not change, and
            # every fork of a rank's workers risks Python's fork hang (own-model.md, 8).
            self.eval_loader = self._loader(
                eval_set, shards, config.eval.batch_size or t.batch_size, persistent=True
            )
        check_data(config, self.loader, self.eval_loader, ctx.world_size)
        comm_state: object | None = None
        """What the comm hook keeps between steps (saved per rank if it has a state_dict)."""
        module = torch.compile(self.model) if t.compile else self.model
        self.ddp = wrap(module, ctx, config)  # type: ignore[arg-type]
        self.comm = CommCounter()
        if isinstance(self.ddp, DistributedDataParallel):
            comm_plugin, comm_options = registry.select(
                "comm_hook", config.comm_hook.name, config.comm_hook.options, "comm_hook"
            )
            comm_state = comm_plugin.factory(self.ddp, ctx=ctx, options=comm_options)
            self.comm = CommCounter(self.ddp, comm_state)
        ckpt_plugin, ckpt_options = registry.select(
            "checkpoint", config.checkpoint.name, config.checkpoint.options, "checkpoint"
        )
        self.checkpointer: Checkpointer = ckpt_plugin.factory(
            ctx=ctx, directory=config.run_dir, options=ckpt_options
        )
        optimizer = build_optimizer(
            t.optimizer,
            self.ddp.parameters(),
            lr=t.lr,
            weight_decay=t.weight_decay,
            options=t.optimizer_options,
            device=ctx.device,
        )
        scheduler = build_scheduler(t.scheduler, optimizer, t.scheduler_options)
        apply_lr_multiplier(optimizer, self.schedule.lr_multiplier, scheduler)
        window = LossWindow(config.data.tasks, ctx.device)
        reduce = config.metrics.reduce if config.metrics is not None else {}
        metrics_key = "metrics.factory" if config.metrics and config.metrics.factory else None
        self.metrics = UserMetrics(
            reduce,
            window.tasks,
            ctx.device,
            metrics_key or "step.metrics",
            measured=has_metrics(self.step_fn),
        )
        self.restarted = all_max(ctx, ctx.restart_count)
        """How many times the launcher restarted the job (the largest count of any rank: a
        node that joined afresh counts from 0)."""
        self.watchdog = Watchdog(ctx, key=str(self.restarted))
        pinned = bool(self.loader.pin_memory)
        self.forward = Forward(
            self.step_fn,
            ctx,
            t.precision,
            self.metrics,
            self.watchdog,
            pinned=pinned,
            per_task=len(window.tasks) > 1,
        )
        self.stepper = Stepper(
            ctx=ctx,
            training=t,
            model=self.model,
            ddp=self.ddp,
            forward=self.forward,
            optimizer=optimizer,
            scheduler=scheduler,
            watchdog=self.watchdog,
            even=sampler_plugin.even,
        )
        faults = FaultInjector(ctx.rank, restart_count=self.restarted)
        if faults:  # in the model's forward: inside DDP's, after its own collectives
            stepper = self.stepper
            self.model.register_forward_pre_hook(lambda *_: faults.check(stepper.attempts))
        self.state = TrainingState(
            config=config,
            ctx=ctx,
            hook=self.hook,
            model=self.model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=self.stepper.scaler,
            schedule=self.schedule,
            sampler=self.sampler,
            dataset=self.dataset,
            checkpointer=self.checkpointer,
            comm_state=comm_state,
            faults=faults,
        )
        flops_per_sample, tokens_per_sample = model_counts(self.model)
        self.reporter = Reporter(
            config,
            ctx,
            self.hook,
            RunFiles(config, ctx),
            window=window,
            metrics=self.metrics,
            flops_per_sample=flops_per_sample,
            tokens_per_sample=tokens_per_sample,
        )
        steps = config.run.profile_steps
        self.profiler = StepProfiler(ctx, config.run_dir, steps) if steps else None
        self.position = Position(step=0, epoch=0)
        self.evaluated_at = -1
        self._grad_norm = float("nan")
        self._location: str | None = None
        self._saved_at = -1
        self._resumed: Resumed | None = None
        signals = (signal.Signals[name] for name in config.checkpoint.preempt_signals)
        self.preemption = Preemption(ctx, signals)

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.position.step

    def train(self) -> TrainResult:
        t, ctx = self.config.training, self.ctx
        self.hook.ups_run_start(ctx=ctx, config=self.config)
        log.info(
            "training",
            world_size=ctx.world_size,
            backend=ctx.backend,
            device=str(ctx.device),
            samples=len(self.dataset),
            epochs=t.epochs,
            precision=t.precision,
            batch_size=self.schedule.batch_size,
            accumulation_steps=self.schedule.accumulation_steps,
        )
        if self.config.checkpoint.resume == "latest" or self.restarted:
            if self.restarted and ctx.is_main:
                log.info("restarted by the launcher: resuming", restarts=self.restarted)
            self._resumed = self.state.resume()
            if self._resumed is not None:
                self.position = self._resumed.position
                self._saved_at = self.step
                if not self.position.epoch_left:
                    set_rng_state(self._resumed.rng, ctx.device)
        check_in_sync(ctx, self.config.digest(), self.step, self.model)
        if self._resumed is not None and not self._steps_left():
            return self._complete()
        self.ddp.train()
        reporter = self.reporter
        reporter.restart_clock(self.step)
        with self.watchdog:  # the loop, then the last evaluation and save: a stuck rank is named
            with (
                self.profiler or contextlib.nullcontext(),
                Progress(ctx, self._total_steps()) as bar,
                self.preemption,
            ):
                reporter.progress = bar
                self._loop()
            preempted = self.preemption.stopped
            if self.step % self.config.run.log_every:
                reporter.start(self.step, self.position.epoch, self._extra)
            reporter.finish(self.step)
            if self.eval_loader is not None and self.evaluated_at != self.step and not preempted:
                self._evaluate()
            if self._saved_at != self.step:
                self._checkpoint()
            self.checkpointer.wait()
        if preempted:
            reporter.files.preempted(self.step)
        losses = tuple(r["loss"] for r in reporter.reports)
        log.info(
            "done",
            steps=self.step,
            epochs=self.position.epoch,
            loss=round(losses[-1], 6) if losses else None,
        )
        return TrainResult(
            steps=self.step,
            epochs=self.position.epoch,
            losses=losses,
            checkpoint=self._location,
            metrics=tuple(reporter.reports),
            eval_metrics=tuple(reporter.eval_reports),
            preempted=preempted,
        )

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
            steps=self.step, epochs=self.position.epoch, losses=(), checkpoint=resumed.location
        )

    def _loop(self) -> None:
        """The epochs and their steps, until the data, ``max_steps`` or the schedule ends them."""
        while self._steps_left():
            if self.loader.batch_sampler.batch_size != self.schedule.batch_size:  # type: ignore[union-attr]
                # a scheduled batch size, from this epoch on
                self.loader = self._loader(self.dataset, self.sampler, self.schedule.batch_size)
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(self.position.epoch)
            batches = self._enter_epoch()
            left = batches.length
            while left and self._more_steps():
                group = min(self.schedule.accumulation_steps, left)
                left -= group
                taken = self.stepper.step(self.step + 1, batches, group)
                self._at(batches, left, taken=taken is not None)
                if taken is None:
                    continue  # every rank skipped the batch
                self._grad_norm, micro_batches = taken
                for counted in micro_batches:
                    counted.count(self.reporter.window, self.metrics)
                if self._after_step():
                    return
            if not left:
                batches.end()  # a sampler longer than its len() is told of

    def _enter_epoch(self) -> Epoch:
        """Start the next epoch's pass over the loader; after a resume mid-epoch, go on where
        it stopped: from the sampler's state, or skipping the taken batches unread. Then the
        generators as they were."""
        batches = self.loader.batch_sampler
        assert batches is not None
        epoch = self.position.epoch
        batches.epoch, batches.first, batches.skip = epoch, 0, 0  # type: ignore[attr-defined]
        resumed, self._resumed = self._resumed, None
        if resumed is not None and resumed.position.epoch_left:
            taken = resumed.position.epoch_taken
            if resumed.replay:
                batches.skip = taken  # type: ignore[attr-defined]
            elif taken:
                batches.first = taken  # type: ignore[attr-defined]
        passing = Epoch(self.loader)
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
        reporter.progress.update(self.step)
        reporter.finish(self.step)
        if self.step % self.config.run.log_every == 0:
            reporter.start(self.step, self.position.epoch, self._extra)
        if self.profiler is not None:
            self._profile_step(self.profiler)
        decision = self.schedule.decide(ctx, self.step, self._maybe_evaluate())
        if decision is not None and decision.lr_multiplier is not None:
            optimizer, scheduler = self.stepper.optimizer, self.stepper.scheduler
            apply_lr_multiplier(optimizer, decision.lr_multiplier, scheduler)
        every = self.config.checkpoint.every_steps
        if (every and self.step % every == 0) or (decision and decision.save):
            self._checkpoint()
        check = self.config.distributed.desync_check_every
        if check and self.step % check == 0:
            check_in_sync(ctx, self.config.digest(), self.step, self.model)
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
        extra |= self.comm.metrics(steps)
        if not math.isnan(self._grad_norm):
            extra["grad_norm"] = self._grad_norm
        return extra

    def _checkpoint(self) -> None:
        self.reporter.check_finite(self.step)
        self._location, self._saved_at = self.state.save(self.position), self.step

    def trial_step(self, batch_size: int) -> None:
        """One optimizer step on ``batch_size`` samples of the data, on this rank alone (no
        collective: through the bare module), to see whether it fits in memory."""
        self.stepper.trial(self._sample_batch(batch_size))

    def _sample_batch(self, size: int) -> Any:
        """A batch of the data's first ``size`` samples (repeated if the data has fewer),
        collated as the loader collates."""
        samples = [self.dataset[i % len(self.dataset)] for i in range(size)]
        return self.loader.collate_fn(samples)

    def _loader(
        self, dataset: Any, sampler: Any, batch_size: int, *, persistent: bool = False
    ) -> DataLoader[Any]:
        """A loader as ``data.loader`` says; its workers kept between passes where
        ``persistent``, whatever ``persistent_workers`` says."""
        options = self.config.data.loader
        if persistent and options.num_workers:
            options = attrs.evolve(options, persistent_workers=True)
        return data_loader(
            dataset,
            sampler,
            batch_size,
            options,
            device=self.ctx.device,
            seed=self.config.run.seed,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
        )

    def _maybe_evaluate(self) -> float | None:
        """Evaluate if this step is an evaluation step; return the loss (the same on every
        rank), or ``None``. Whether to evaluate depends on the step alone: every rank agrees."""
        every = self.config.eval.every_steps if self.config.eval else None
        if every and self.step % every == 0:
            return self._evaluate()["loss"]
        return None

    def _evaluate(self) -> dict[str, float]:
        assert self.eval_loader is not None
        shards = self.eval_loader.batch_sampler.sampler  # type: ignore[union-attr]
        if hasattr(shards, "set_epoch"):  # a new order each evaluation, for one that shuffles
            shards.set_epoch(len(self.reporter.eval_reports))
        reduce = self.config.metrics.reduce if self.config.metrics else {}
        metrics = evaluate(
            self.model, self.eval_loader, self.forward, self.config.data.tasks, reduce
        )
        self.evaluated_at = self.step
        self.reporter.evaluated(self.step, metrics)
        return metrics

    def _more_steps(self) -> bool:
        max_steps = self.config.training.max_steps
        return not self.schedule.stopped and (max_steps is None or self.step < max_steps)

    def _total_steps(self) -> int:
        """The optimizer steps the run will take, as the config stands (for the progress bar)."""
        per_epoch = math.ceil(len(self.loader) / self.schedule.accumulation_steps)
        total = per_epoch * self.config.training.epochs
        return min(total, self.config.training.max_steps or total)

    def _profile_step(self, profiler: StepProfiler) -> None:
        """Tell the profiler a step ended; when its trace is written, measure the
        communication profile (every rank reaches this at the same step)."""
        profiler.step()
        if profiler.trace is None:
            return
        self.profiler = None
        batch = self._sample_batch(self.schedule.batch_size)

        def step(sync: bool) -> None:
            self.stepper.backward_alone(batch, sync=sync)
            self.stepper.optimizer.zero_grad(set_to_none=True)

        profile = comm_profile(self.ctx, step)
        log.info("communication profile", trace=str(profiler.trace), **profile.summary())
        if self.ctx.is_main:
            (profiler.trace.parent / "comm.json").write_text(json.dumps(profile.as_dict()))
