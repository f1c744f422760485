"""The training loop: build what the config names, wrap it in DDP, train, report, checkpoint.

Each optimizer step takes ``training.accumulation_steps`` micro-batches; gradients are
synchronised across ranks on the last one only (``no_sync`` on the others), unscaled once (fp16),
clipped once to a global norm that is the same number on every rank, then applied.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.metadata
import inspect
import itertools
import json
import math
import signal
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, default_collate

from .collectives import Failure, RankFailedError, all_max, gather_failures
from .config import Config, FactoryConfig
from .context import RunContext
from .desync import check_in_sync
from .errors import ConfigError, UsageError
from .evaluation import evaluate
from .faults import FaultInjector
from .imports import load_object
from .logs import rank_log_file
from .metrics import LossWindow, PendingReport, per_sample_losses
from .optim import build_optimizer, build_scheduler
from .plugins import Registry
from .preemption import Preemption
from .profiling import CommCounter, StepProfiler, comm_profile, model_counts, throughput
from .progress import Progress
from .records import Checkpointer, Loaded
from .rng import rng_state, seed_all, set_rng_state
from .rundir import RunFiles
from .schedule import Schedule, apply_lr_multiplier
from .user_metrics import PendingMetrics, UserMetrics
from .validate import select_sampler
from .watchdog import DONE, FORWARD, FORWARD_DONE, STARTED, Watchdog

log = structlog.get_logger()

Batch = Sequence[torch.Tensor]
"""``(inputs, targets)`` or ``(inputs, targets, task_ids)``."""
Taken = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]
"""What a micro-batch adds to the metrics: per-sample losses, task ids, user metrics."""

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@attrs.frozen(kw_only=True)
class TrainResult:
    """What a run leaves behind; the same on every rank."""

    steps: int
    """Optimizer steps taken."""
    epochs: int
    """Epochs started."""
    losses: tuple[float, ...]
    """The training loss at each report, averaged over the interval and over all ranks."""
    checkpoint: str | None
    """Where the final checkpoint went."""
    preempted: bool = False
    """Whether a signal stopped the run early (saved where it stopped, to resume)."""
    metrics: tuple[dict[str, float], ...] = ()
    """Every report's metrics (``loss``, ``loss/<task>``, ``grad_norm``, ``lr``,
    ``samples_per_s``, ``oom_skipped``, user metrics, ...)."""
    eval_metrics: tuple[dict[str, float], ...] = ()
    """Every evaluation's metrics, over the whole evaluation set (``loss``, ``loss/<task>``)."""


def build_model(config: Config) -> nn.Module:
    """Call ``model.factory(**model.options)``; check that it returns a module."""
    model = load_object(config.model.factory, "model.factory")(**config.model.options)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model.factory", f"returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_dataset(section: FactoryConfig, key: str) -> Any:
    """Call the ``section`` (``data`` or ``eval``) factory with its options; check that it
    returns a map-style dataset."""
    dataset = load_object(section.factory, f"{key}.factory")(**section.options)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            f"{key}.factory", f"returned {type(dataset).__name__}, not a map-style dataset"
        )
    return dataset


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
    try:
        with rank_log_file(ctx, config.run_dir):
            result = Run(config, ctx, registry).train()
    except BaseException as error:
        hook.ups_error(ctx=ctx, error=error)
        raise
    hook.ups_run_end(ctx=ctx, result=result)
    return result


class Run:
    """One rank's training run: what it built from the config, and the loop over it.
    :func:`train` is how to use it; ``ups tune`` uses :meth:`trial_step`."""

    def __init__(self, config: Config, ctx: RunContext, registry: Registry) -> None:
        self.config, self.ctx, self.hook = config, ctx, registry.manager.hook
        t = config.training
        seed_all(config.run.seed)
        self.model = build_model(config).to(ctx.device)
        if ctx.distributed and config.distributed.sync_batchnorm:
            convert = nn.SyncBatchNorm.convert_sync_batchnorm
            self.model = convert(self.model)  # type: ignore[no-untyped-call]
        dataset = build_dataset(config.data, "data")
        sampler_plugin, sampler_options = select_sampler(
            registry, config.sampler, "sampler", exact=False
        )
        self.sampler = sampler_plugin.factory(
            dataset, ctx=ctx, seed=config.run.seed, options=sampler_options
        )
        self.dataset = dataset
        self.schedule = Schedule(
            config.schedule, batch_size=t.batch_size, accumulation_steps=t.accumulation_steps
        )
        self.loader = self._loader()
        self.eval_loader = None
        if config.eval is not None:
            eval_set = build_dataset(config.eval, "eval")
            plugin, options = select_sampler(
                registry, config.eval.sampler, "eval.sampler", exact=True
            )
            shards = plugin.factory(eval_set, ctx=ctx, seed=config.run.seed, options=options)
            batch_size = config.eval.batch_size or t.batch_size
            self.eval_loader = DataLoader(eval_set, batch_size=batch_size, sampler=shards)
        self.comm_state: object | None = None
        """What the comm hook keeps between steps (saved per rank if it has a state_dict)."""
        module = torch.compile(self.model) if t.compile else self.model
        self.ddp = wrap(module, ctx, config)  # type: ignore[arg-type]
        self.comm = CommCounter()
        if isinstance(self.ddp, DistributedDataParallel):
            comm_plugin, comm_options = registry.select(
                "comm_hook", config.comm_hook.name, config.comm_hook.options, "comm_hook"
            )
            self.comm_state = comm_plugin.factory(self.ddp, ctx=ctx, options=comm_options)
            self.comm = CommCounter(self.ddp, self.comm_state)
        ckpt_plugin, ckpt_options = registry.select(
            "checkpoint", config.checkpoint.name, config.checkpoint.options, "checkpoint"
        )
        self.checkpointer: Checkpointer = ckpt_plugin.factory(
            ctx=ctx, directory=config.run_dir, options=ckpt_options
        )
        self.optimizer = build_optimizer(
            t.optimizer,
            self.ddp.parameters(),
            lr=t.lr,
            weight_decay=t.weight_decay,
            options=t.optimizer_options,
            device=ctx.device,
        )
        self.scheduler = build_scheduler(t.scheduler, self.optimizer, t.scheduler_options)
        apply_lr_multiplier(self.optimizer, self.schedule.lr_multiplier, self.scheduler)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=t.precision == "fp16")
        self.window = LossWindow(config.data.tasks, ctx.device)
        self.user_metrics = None
        if config.metrics is not None:
            fn = load_object(config.metrics.factory, "metrics.factory")(**config.metrics.options)
            self.user_metrics = UserMetrics(fn, config.metrics.reduce, ctx.device)
        self.files = RunFiles(config, ctx)
        self.step = self.epoch = self.attempts = 0
        self.restarted = all_max(ctx, ctx.restart_count)
        """How many times the launcher restarted the job (the largest count of any rank: a
        node that joined afresh counts from 0)."""
        self.watchdog = Watchdog(ctx, key=str(self.restarted))
        self.model.register_forward_pre_hook(lambda *_: self.watchdog.mark(self.attempts, FORWARD))
        self.model.register_forward_hook(lambda *_: self.watchdog.mark(self.attempts, FORWARD_DONE))
        self.faults = FaultInjector(ctx.rank, restart_count=self.restarted)
        if self.faults:  # in the model's forward: inside DDP's, after its own collectives
            self.model.register_forward_pre_hook(lambda *_: self.faults.check(self.attempts))
        self.oom_skipped = self.oom_in_a_row = 0
        self.agree = t.skip_oom
        if self.agree == "auto":
            self.agree = ctx.device.type == "cuda" or not ctx.distributed
        self.flops_per_sample, self.tokens_per_sample = model_counts(self.model)
        steps = config.run.profile_steps
        self.profiler = StepProfiler(ctx, config.run_dir, steps) if steps else None
        self.evaluated_at = -1
        self.reports: list[dict[str, float]] = []
        self.eval_reports: list[dict[str, float]] = []
        self._pending: _Report | None = None
        self._reported_at = (0, 0.0)
        self._grad_norm = float("nan")
        self._location: str | None = None
        self._saved_at = -1
        self._epoch_left = 0
        """Batches of the current epoch not taken yet (saved: where to resume)."""
        self._resumed: tuple[int | None, dict[str, Any]] | None = None
        """After a resume mid-epoch: the batches left of it to replay up to (``None``: the
        sampler's state did), and the RNG states to go on with."""
        signals = (signal.Signals[name] for name in config.checkpoint.preempt_signals)
        self.preemption = Preemption(ctx, signals)
        self.progress = Progress(ctx, None, enabled=False)

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
            self._resume()
        check_in_sync(ctx, self.config.digest(), self.step, self.model)
        self.ddp.train()
        self._reported_at = (self.step, time.perf_counter())
        with (
            self.profiler or contextlib.nullcontext(),
            Progress(ctx, self._total_steps()) as bar,
            self.preemption,
            self.watchdog,
        ):
            self.progress = bar
            self._loop()
        preempted = self.preemption.stopped
        if self.step % self.config.run.log_every:
            self._start_report(self._grad_norm)
        self._finish_report()
        if self.eval_loader is not None and self.evaluated_at != self.step and not preempted:
            self._evaluate()
        if self._saved_at != self.step:
            self._location = self._checkpoint()
        self.checkpointer.wait()
        if preempted:
            self.files.preempted(self.step)
        losses = tuple(r["loss"] for r in self.reports)
        log.info(
            "done",
            steps=self.step,
            epochs=self.epoch,
            loss=round(losses[-1], 6) if losses else None,
        )
        return TrainResult(
            steps=self.step,
            epochs=self.epoch,
            losses=losses,
            checkpoint=self._location,
            metrics=tuple(self.reports),
            eval_metrics=tuple(self.eval_reports),
            preempted=preempted,
        )

    def _loop(self) -> None:
        """The epochs and their steps, until the data, ``max_steps`` or the schedule ends them."""
        t, ctx = self.config.training, self.ctx
        while self._more_steps() and self.epoch < t.epochs:
            if self.loader.batch_size != self.schedule.batch_size:
                self.loader = self._loader()  # a scheduled batch size, from this epoch on
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(self.epoch)
            self.epoch += 1
            batches, left = iter(self.loader), len(self.loader)
            if self._resumed is not None:
                left = self._go_on(batches, left)
            self._epoch_left = left
            while left and self._more_steps():
                group = min(self.schedule.accumulation_steps, left)
                left = self._epoch_left = left - group
                norm = self._optimizer_step(batches, group)
                if norm is None:
                    continue  # every rank skipped the batch
                self._grad_norm = norm
                self.step += 1
                self.progress.update(self.step)
                self._finish_report()
                if self.step % self.config.run.log_every == 0:
                    self._start_report(norm)
                if self.profiler is not None:
                    self._profile_step(self.profiler)
                decision = self.schedule.decide(ctx, self.step, self._maybe_evaluate())
                if decision is not None and decision.lr_multiplier is not None:
                    apply_lr_multiplier(self.optimizer, decision.lr_multiplier, self.scheduler)
                every = self.config.checkpoint.every_steps
                if (every and self.step % every == 0) or (decision and decision.save):
                    self._location, self._saved_at = self._checkpoint(), self.step
                check = self.config.distributed.desync_check_every
                if check and self.step % check == 0:
                    check_in_sync(ctx, self.config.digest(), self.step, self.model)
                if self.preemption.agreed():
                    log.warning("preempted: saving and stopping", step=self.step)
                    return

    def _resume(self) -> None:
        """Continue from the newest checkpoint, if any: the model, optimizer, scheduler,
        scaler, schedule, step and epoch, the comm hook's and plugins' states, and mid-epoch
        where it stopped, the sampler's position (or, for a sampler without a state, the
        epoch's batches replayed unread up to it); then every generator as it was."""
        loaded = self.checkpointer.load_latest()
        if loaded is None:
            log.info("no checkpoint to resume from: starting afresh")
            return
        state = loaded.state
        self._check_identity(loaded.step, state.get("identity", {}))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.schedule.load_state_dict(state["schedule"])
        load = getattr(self.sampler, "load_state_dict", None) if state["sampler"] else None
        if load is not None:
            load(state["sampler"])
        own = self._restore_own(loaded)
        self.step, self.epoch, left = state["step"], state["epoch"], state["epoch_left"]
        rng = own["rng"] if own is not None else state["rng"]
        if left:  # stopped mid-epoch: the loop enters that epoch again
            self.epoch -= 1
            replay: int | None = None if load is not None else left
            if replay is not None and state["world_size"] != self.ctx.world_size:
                log.warning(
                    "the sampler has no state to deal the rest of the epoch to another number "
                    "of ranks: the epoch starts over",
                    saved_world_size=state["world_size"],
                )
                replay = None
            self._resumed = (replay, rng)
        else:
            set_rng_state(rng, self.ctx.device)
        changed = state["config_digest"] != self.config.digest()
        log.info("resumed", step=loaded.step, epoch=state["epoch"], config_changed=changed)

    def _restore_own(self, loaded: Loaded) -> dict[str, Any] | None:
        """Restore the comm hook's state (this rank's) and the plugins' states (this rank's,
        else rank 0's); this rank's saved state, if the checkpoint has one."""
        own = loaded.rank_state
        if own is None and self.ctx.is_main:
            log.warning(
                "checkpoint saved by another number of ranks: each rank's generators start "
                "from rank 0's and the comm hook's state starts afresh",
                saved_world_size=loaded.state["world_size"],
            )
        load = getattr(self.comm_state, "load_state_dict", None)
        if own is not None and load is not None and "comm_hook" in own:
            self._restore_comm_hook(load, own)
        plugins = own["plugins"] if own is not None else loaded.state["plugins"]
        self.hook.ups_checkpoint_restore(ctx=self.ctx, state=plugins)
        return own

    def _restore_comm_hook(self, load: Callable[[Any], None], own: Mapping[str, Any]) -> None:
        """Hand the comm hook its saved state, if the hook that saved it is this run's; else
        warn that its state starts afresh.

        :raises ConfigError: naming ``comm_hook.options`` when the hook refuses the state (saved
            with options that shape it otherwise, such as another PowerSGD rank).
        """
        name = self.config.comm_hook.name
        saved_by = own.get("comm_hook_name", name)
        if saved_by != name:
            if self.ctx.is_main:
                log.warning(
                    f"the checkpoint's comm hook state was saved by {saved_by!r}, not by {name!r}"
                    " as now: its state starts afresh"
                )
            return
        try:
            load(own["comm_hook"])
        except ValueError as error:
            raise ConfigError(
                "comm_hook.options", f"cannot resume the checkpoint: {error}"
            ) from None

    def _identity(self) -> dict[str, Any]:
        """What a resume must find unchanged, unless ``checkpoint.allow_changed`` says. The
        dataset is known by its size and its tasks' sizes, and by its own ``fingerprint``
        (a string attribute, as Hugging Face datasets have ``_fingerprint``) where it has one."""
        parts = getattr(self.dataset, "datasets", None)
        sizes = [len(part) for part in parts] if parts else [len(self.dataset)]
        own = getattr(self.dataset, "fingerprint", getattr(self.dataset, "_fingerprint", None))
        return {
            "seed": self.config.run.seed,
            "accumulation_steps": self.config.training.accumulation_steps,
            "dataset": [*sizes, own] if isinstance(own, str) else sizes,
        }

    def _check_identity(self, step: int, saved: dict[str, Any]) -> None:
        """Refuse to continue a run whose seed, accumulation or data changed, unless allowed.

        :raises ConfigError: on every rank (each reads the same checkpoint), naming the key.
        """
        allowed = self.config.checkpoint.allow_changed
        for key, value in self._identity().items():
            if key in saved and saved[key] != value and key not in allowed:
                raise ConfigError(
                    "checkpoint.resume",
                    f"the checkpoint of step {step} was saved with {key} {saved[key]!r}, this "
                    f"run has {value!r}; start afresh (checkpoint.resume: none), or accept it "
                    f"with --allow-changed {key}",
                )

    def _go_on(self, batches: Iterator[Any], left: int) -> int:
        """Enter the epoch a resumed run stopped in: the sampler's state went on from where
        it was; a sampler without one starts the epoch over, so skip the batches taken
        before (unread). Then the RNG as it was. The batches left."""
        assert self._resumed is not None
        (rest, rng), self._resumed = self._resumed, None
        if rest is not None:
            for _ in range(left - rest):
                next(batches)
            left = rest
        set_rng_state(rng, self.ctx.device)
        return left

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
        local = isinstance(self.ddp, DistributedDataParallel)

        def step(sync: bool) -> None:
            module = typing.cast(nn.Module, self.ddp.module) if local and not sync else self.ddp
            loss = self._forward(module, batch, 1, [])
            if local and not sync:
                self._accumulate_locally(loss)
            else:
                loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.zero_grad(set_to_none=True)

        profile = comm_profile(self.ctx, step)
        log.info("communication profile", trace=str(profiler.trace), **profile.summary())
        if self.ctx.is_main:
            (profiler.trace.parent / "comm.json").write_text(json.dumps(profile.as_dict()))

    def trial_step(self, batch_size: int) -> None:
        """One optimizer step on ``batch_size`` samples of the data, on this rank alone (no
        collective: through the bare module), to see whether it fits in memory."""
        local = isinstance(self.ddp, DistributedDataParallel)
        module = typing.cast(nn.Module, self.ddp.module) if local else self.ddp
        loss = self._forward(module, self._sample_batch(batch_size), 1, [])
        if local:
            self._accumulate_locally(loss)
        else:
            loss.backward()  # type: ignore[no-untyped-call]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _sample_batch(self, size: int) -> Batch:
        """A batch of the data's first ``size`` samples (repeated if the data has fewer)."""
        return default_collate([self.dataset[i % len(self.dataset)] for i in range(size)])  # type: ignore[no-any-return]

    def _loader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=self.schedule.batch_size, sampler=self.sampler)

    def _maybe_evaluate(self) -> float | None:
        """Evaluate if this step is an evaluation step; return the loss (the same on every
        rank), or ``None``. Whether to evaluate depends on the step alone: every rank agrees."""
        every = self.config.eval.every_steps if self.config.eval else None
        if every and self.step % every == 0:
            return self._evaluate()["loss"]
        return None

    def _evaluate(self) -> dict[str, float]:
        assert self.eval_loader is not None
        shards = self.eval_loader.sampler
        if hasattr(shards, "set_epoch"):  # a new order each evaluation, for one that shuffles
            shards.set_epoch(len(self.eval_reports))
        metrics = evaluate(
            self.model,
            self.eval_loader,
            self.ctx,
            loss=self.config.training.loss,
            tasks=self.config.data.tasks,
            autocast=self._autocast,
        )
        self.evaluated_at = self.step
        log.info("eval", step=self.step, **{f"val_{k}": _round(v) for k, v in metrics.items()})
        self.hook.ups_eval_end(ctx=self.ctx, step=self.step, metrics=metrics)
        self.files.metrics("eval", self.step, metrics)
        self.eval_reports.append(metrics)
        return metrics

    def _more_steps(self) -> bool:
        max_steps = self.config.training.max_steps
        return not self.schedule.stopped and (max_steps is None or self.step < max_steps)

    def _optimizer_step(self, batches: Iterator[Batch], group: int) -> float | None:
        """Forward and backward ``group`` micro-batches, then one optimizer step; return the
        gradient norm before clipping (NaN when not clipping), or ``None`` when every rank
        skipped the step because one ran out of memory.

        What fails before the synchronising backward (loading, forward passes, the local
        backward passes) is agreed on by every rank before any of them goes on: once before the
        last micro-batch's forward through DDP (which may hold collectives of its own), once
        after it. Each agreement is one all-reduce of a flag when all went well.
        """
        t = self.config.training
        self.attempts += 1
        self.watchdog.mark(self.attempts, STARTED)
        micro_batches = itertools.islice(batches, group)
        taken: list[Taken] = []
        losses: list[torch.Tensor] = []
        if (
            group > 1 and not self._agreed(self._local_micro_batches, micro_batches, group, taken)
        ) or not self._agreed(self._synced_forward, micro_batches, group, taken, losses):
            collections.deque(micro_batches, maxlen=0)  # read the rest: ranks stay in step
            return None
        self.oom_in_a_row = 0
        losses[0].backward()  # type: ignore[no-untyped-call]
        for per_sample, task_ids, values in taken:
            self.window.add(per_sample, task_ids)
            if self.user_metrics is not None:
                self.user_metrics.add(values, len(per_sample))
        grad_norm = float("nan")
        if t.grad_clip_norm is not None:
            self.scaler.unscale_(self.optimizer)
            # Gradients are already averaged over ranks: the norm is the same on every rank.
            grad_norm = float(nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip_norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.watchdog.mark(self.attempts, DONE)
        return grad_norm

    def _agreed(self, work: Callable[..., None], *args: Any) -> bool:
        """Run ``work(*args)`` and tell whether every rank did it without failing; if one ran
        out of memory, every rank skips the step (``False``); any other failure is raised on
        every rank. A collective, with ``training.skip_oom`` on; else failures just raise."""
        if not self.agree:
            work(*args)
            return True
        error = None
        try:
            work(*args)
        except Exception as failure:
            error = failure
        failures = gather_failures(self.ctx, error)
        if failures:
            self._skip(failures, error)
        return not failures

    def _local_micro_batches(
        self, micro_batches: Iterator[Batch], group: int, taken: list[Taken]
    ) -> None:
        """Forward and backward every micro-batch of the step but the last, keeping their
        gradients on this rank: through the bare module, so no collective runs."""
        local = isinstance(self.ddp, DistributedDataParallel)
        module = typing.cast(nn.Module, self.ddp.module) if local else self.ddp
        for batch in itertools.islice(micro_batches, group - 1):
            loss = self._forward(module, batch, group, taken)
            if local:
                self._accumulate_locally(loss)
            else:
                loss.backward()  # type: ignore[no-untyped-call]

    def _synced_forward(
        self,
        micro_batches: Iterator[Batch],
        group: int,
        taken: list[Taken],
        losses: list[torch.Tensor],
    ) -> None:
        """Forward the step's last micro-batch through DDP; its backward synchronises."""
        losses.append(self._forward(self.ddp, next(micro_batches), group, taken))

    def _forward(
        self, module: nn.Module, batch: Batch, group: int, taken: list[Taken]
    ) -> torch.Tensor:
        """One micro-batch's forward pass: return its scaled loss (a ``group``-th of the mean),
        and append to ``taken`` its per-sample losses, task ids and user metrics, for the
        caller to count once the step is sure to be taken."""
        inputs, targets = batch[0].to(self.ctx.device), batch[1].to(self.ctx.device)
        with self._autocast():
            out = module(inputs)
            per_sample = per_sample_losses(self.config.training.loss, out, targets)
        values = self.user_metrics.compute(out, targets) if self.user_metrics else {}
        taken.append((per_sample, batch[2] if len(batch) > 2 else None, values))
        return self.scaler.scale(per_sample.mean() / group)

    def _skip(self, failures: list[Failure], error: Exception | None) -> None:
        """Skip the step on every rank if ranks only ran out of memory (and not too often in a
        row); else raise on every rank: a failed rank its own error, the others a
        :class:`RankFailedError` naming the first rank that failed and how."""
        step = self.step + 1
        crashed = [f for f in failures if not f.out_of_memory]
        if crashed:
            if error is not None and not Failure(0, type(error).__name__, str(error)).out_of_memory:
                raise error
            raise RankFailedError(f"step {step}: {crashed[0]}")
        self.oom_skipped += 1
        self.oom_in_a_row += 1
        ranks = [f.rank for f in failures]
        limit = self.config.training.max_oom_skips
        if self.oom_in_a_row > limit:
            raise RankFailedError(
                f"step {step}: out of memory on rank {', '.join(map(str, ranks))} "
                f"{self.oom_in_a_row} times in a row (training.max_oom_skips: {limit}); "
                "lower training.batch_size (`ups tune` finds the largest that fits)"
            ) from error
        if self.ctx.is_main:
            log.warning("out of memory: every rank skips the batch", step=step, ranks=ranks)
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()

    def _accumulate_locally(self, loss: torch.Tensor) -> None:
        """Add ``loss``'s gradients to ``.grad`` without DDP's reducer seeing them; the last
        micro-batch's backward then all-reduces the sum, as ``no_sync`` would.

        Not ``ddp.no_sync()``: with ``static_graph=True`` it trips an internal assert in DDP's
        reducer (pytorch/pytorch#143580, huggingface/accelerate#3679). ``autograd.grad`` never
        runs the gradient accumulators, where the reducer's hooks sit.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for param, grad in zip(params, grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad.add_(grad)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        precision = self.config.training.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=AUTOCAST_DTYPES[precision])

    def _start_report(self, grad_norm: float) -> None:
        self._finish_report()
        last_step, last_time = self._reported_at
        self._reported_at = (self.step, time.perf_counter())
        extra = {"lr": self.optimizer.param_groups[0]["lr"], "oom_skipped": self.oom_skipped}
        extra |= self.comm.metrics(self.step - last_step)
        if not math.isnan(grad_norm):
            extra["grad_norm"] = grad_norm
        self._pending = _Report(
            step=self.step,
            epoch=self.epoch,
            extra=extra,
            losses=self.window.report(self.ctx),
            user=self.user_metrics.report(self.ctx) if self.user_metrics else None,
            steps=self.step - last_step,
            seconds=self._reported_at[1] - last_time,
        )

    def _finish_report(self) -> None:
        """Log and hand on the report started at an earlier step, if any."""
        report, self._pending = self._pending, None
        if report is None:
            return
        metrics = report.losses.result()
        if report.user is not None:
            metrics |= report.user.result()
        metrics |= report.extra
        metrics |= throughput(
            metrics["samples"],
            report.seconds,
            world_size=self.ctx.world_size,
            flops_per_sample=self.flops_per_sample,
            tokens_per_sample=self.tokens_per_sample,
            peak_flops=self.config.training.peak_flops,
        )
        metrics["step_time_s"] = report.seconds / report.steps
        step = report.step
        self.progress.update(self.step, metrics)
        log.info(
            "step", step=step, epoch=report.epoch, **{k: _round(v) for k, v in metrics.items()}
        )
        self.hook.ups_step_end(ctx=self.ctx, step=step, metrics=metrics)
        self.files.metrics("train", step, metrics)
        self.reports.append(metrics)

    def _checkpoint(self) -> str:
        """Save the training state: replicated (rank 0's is kept), and each rank's own
        (its generators, the comm hook's state, the plugins' states)."""
        own: dict[str, Any] = {"rng": rng_state(self.ctx.device), "plugins": self._plugin_states()}
        state_dict = getattr(self.comm_state, "state_dict", None)
        if state_dict is not None:
            own["comm_hook"] = state_dict()
            own["comm_hook_name"] = self.config.comm_hook.name
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "schedule": self.schedule.state_dict(),
            "sampler": self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else {},
            "epoch_left": self._epoch_left,
            "world_size": self.ctx.world_size,
            "identity": self._identity(),
            "rng": own["rng"],
            "plugins": own["plugins"],
            "config_digest": self.config.digest(),
            "versions": dict(_versions()),
        }
        with self.faults.saving(self.step):
            location = self.checkpointer.save(state, step=self.step, rank_state=own)
        self.hook.ups_checkpoint_saved(ctx=self.ctx, step=self.step, location=location)
        log.info("checkpoint saved", step=self.step, location=location)
        return location

    def _plugin_states(self) -> dict[str, Any]:
        """Every plugin's :func:`~ups.core.hookspecs.ups_checkpoint_state`, by key."""
        states: dict[str, Any] = {}
        for returned in self.hook.ups_checkpoint_state(ctx=self.ctx):
            for key, value in (returned or {}).items():
                if key in states:
                    raise UsageError(f"two plugins save checkpoint state under the key {key!r}")
                states[key] = value
        return states


@attrs.frozen(kw_only=True)
class _Report:
    """A report on its way: what is known at its step, and the all-reduces still running."""

    step: int
    epoch: int
    extra: dict[str, float]
    losses: PendingReport
    user: PendingMetrics | None
    steps: int
    """Optimizer steps since the report before."""
    seconds: float
    """Wall time since the report before (this rank's)."""


def _round(value: float) -> float:
    return round(value, 6) if isinstance(value, float) else value


@functools.cache
def _versions() -> dict[str, str]:
    """The versions of torch and of the ups distributions installed, as checkpoints record."""
    found = {"torch": str(torch.__version__)}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.startswith("ups-"):
            found[name] = dist.version
    return found
