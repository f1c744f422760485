"""The optimizer step: micro-batches through the user's :class:`~ups.core.Step`, forward and
backward, then one update.

Each optimizer step takes ``training.accumulation_steps`` micro-batches; gradients are
synchronised across ranks on the last one only (the others accumulate on each rank, as the
:class:`~ups.core.Strategy` runs them: DDP's bare module), unscaled once (fp16), clipped once to a global norm that is the same number on
every rank, then applied. Every sample of a step weighs the same, whichever micro-batch and
rank it is on (:class:`Weights`). What fails before the synchronising backward is agreed on by
every rank (``training.skip_oom``): out of memory skips the step everywhere, anything else stops
every rank naming the one that failed. What goes bad after it (a gradient norm that is not
finite, or spikes) is judged alike on every rank by the :class:`~ups.core.engine._guard.Guard`
(``training.guard``), which has every rank skip the step, roll back or stop (the run's loop
records the step and does it).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import attrs
import structlog
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ..config._config import TrainingConfig
from ..config._errors import ConfigError, UsageError
from ..dist._collectives import Agreement, Failure, RankFailedError, sum_later
from ..dist._context import RunContext
from ..dist._watchdog import BACKWARD, DONE, EVALUATING, FORWARD, FORWARD_DONE, STARTED, Watchdog
from ..observe._metrics import LossWindow
from ..observe._phases import BACKWARD as BACKWARD_PHASE
from ..observe._phases import COLLECTIVES, DATA, OPTIMIZER, NoTimer, StepTimer
from ..observe._phases import FORWARD as FORWARD_PHASE
from ..observe._step_metrics import UserMetrics
from ._batches import to_device
from ._guard import Guard
from ._optim import is_plateau
from ._step import Step, StepError, _raw, batch_mean
from ._strategy import Strategy

log = structlog.get_logger()

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()
"""fp32's autocast: none (a ``nullcontext`` may be entered again and again)."""

Kind = Literal["samples", "count", "mean"]
"""What a step's ``loss`` returned: one loss per sample, ``(mean, count)``, or a 0-d mean."""

KIND_NAMES: dict[Kind, str] = {
    "samples": "one loss per sample",
    "count": "(mean, count)",
    "mean": "a 0-d mean",
}


@attrs.frozen
class Loss:
    """A micro-batch's loss as its optimizer step weighs it: :attr:`total` adds up ``count``
    items, each of which weighs the same in the step."""

    value: torch.Tensor
    """What the step's ``loss`` gave: the per-sample losses, or a 0-d mean; or, ``averaged``,
    the per-sample losses' mean."""
    count: int
    """The samples; the count of ``(mean, count)``; 1 for a 0-d mean (its micro-batch then
    counts once, whatever its size)."""
    kind: Kind
    averaged: bool = False
    """Whether ``value`` is the mean of the per-sample losses (``kind`` ``samples``) taken in
    one operation (the built-in step's loss by name: :func:`~ups.core.engine._step.batch_mean`)."""

    @property
    def total(self) -> torch.Tensor:
        """The per-sample losses' sum; ``mean * count`` for ``(mean, count)``; a 0-d mean."""
        if self.kind == "samples":
            return self.value * self.count if self.averaged else self.value.sum()
        return self.value * self.count if self.kind == "count" else self.value

    @property
    def mean(self) -> torch.Tensor:
        """The micro-batch's mean loss: what a step of this micro-batch alone differentiates
        (one operation at most: the mean of per-sample losses)."""
        if self.kind == "samples" and not self.averaged:
            return self.value.mean()
        return self.value


@attrs.frozen
class Taken:
    """What a micro-batch adds to the metrics, counted once its step is sure to be taken."""

    loss: torch.Tensor
    """Per-sample losses (``[samples]``), or the batch's mean (0-d)."""
    samples: int
    task_ids: torch.Tensor | None
    metrics: dict[str, torch.Tensor]
    weight: int
    """What a mean loss counts for: the samples (or tokens) it averages over."""

    def count(self, window: LossWindow, metrics: UserMetrics) -> None:
        """Add this micro-batch to the loss window and the user metrics."""
        if self.loss.dim():
            window.add(self.loss, self.task_ids)
        else:
            window.add_mean(self.loss, self.weight)
        metrics.add(self.metrics, self.samples, self.task_ids)


class Forward:
    """One micro-batch through a step: to the device, the step's forward and loss under
    autocast, its metrics without gradients; the same in training, evaluation and trials.
    ``watchdog`` is told the phase (the forward begun and done, or an evaluation's forward, as
    the module's mode says) and which user code runs, by the config key naming it: a step's own
    ``forward`` and ``loss`` (``step.factory``), the metrics (``metrics.factory``)."""

    def __init__(
        self,
        step: Step,
        ctx: RunContext,
        precision: str,
        metrics: UserMetrics,
        watchdog: Watchdog,
        *,
        pinned: bool,
        per_task: bool = False,
    ) -> None:
        self.step, self.ctx, self.metrics, self.watchdog = step, ctx, metrics, watchdog
        self._precision, self._non_blocking = precision, pinned and ctx.device.type == "cuda"
        self._mean = batch_mean(step)
        """The built-in step's loss by name is taken as the batch's mean in one operation: what
        the step differentiates (:class:`Loss`'s ``averaged``) and, with one task, what the
        report adds up; with several (``per_task``), the report's per-sample losses are taken
        without gradients."""
        self._per_task = per_task
        self.name = type(step).__qualname__
        """The step's class, as messages name it."""
        own_forward = type(step).forward is not Step.forward
        own_loss = type(step).loss is not Step.loss or callable(_raw(step, "criterion"))
        self._forward_key = f"step.factory ({self.name}.forward)" if own_forward else None
        self._loss_key = f"step.factory ({self.name}.loss)" if own_loss else None

    def __call__(
        self, module: nn.Module, batch: Any, samples: int | None = None
    ) -> tuple[Loss, Taken]:
        """The micro-batch's loss (to differentiate, once weighed) and what it adds to the
        metrics. ``samples``: the batch's ``step.batch_size``, when counted already."""
        step, watchdog, training = self.step, self.watchdog, module.training
        batch = to_device(batch, self.ctx.device, non_blocking=self._non_blocking)
        with self.autocast():
            watchdog.phase(FORWARD if training else EVALUATING)
            with watchdog.calling(self._forward_key):
                outputs = step.forward(module, batch)
            watchdog.phase(FORWARD_DONE if training else EVALUATING)
            if samples is None:
                samples = step.batch_size(batch)
            mean = self._mean(outputs, batch) if self._mean is not None else None
            if mean is not None and len(outputs) == samples:
                loss, counted, weight = Loss(mean, samples, "samples", averaged=True), mean, samples
                if self._per_task:
                    with torch.no_grad():
                        counted = step.loss(outputs, batch)  # type: ignore[assignment]
            else:
                with watchdog.calling(self._loss_key):
                    returned = step.loss(outputs, batch)
                loss, counted, weight = self._checked(returned, samples)
        values = {}
        if self.metrics.measured:
            with torch.no_grad(), self.watchdog.calling(self.metrics.key):
                values = self.metrics.check(step.metrics(outputs, batch), samples)
        return loss, Taken(counted.detach(), samples, step.task_ids(batch), values, weight)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast (none for fp32)."""
        if self._precision == "fp32":
            return _NO_AUTOCAST
        return torch.autocast(self.ctx.device.type, dtype=AUTOCAST_DTYPES[self._precision])

    def _checked(self, returned: Any, samples: int) -> tuple[Loss, torch.Tensor, int]:
        """The loss to weigh, the per-sample (or mean) loss to report, and what a mean counts
        for in the report, from what ``loss`` gave.

        :raises StepError: naming the step's ``loss`` and what it should have returned.
        """
        loss, count = returned, None
        if isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[1], int):
            loss, count = returned
        weight = samples if count is None else count
        if isinstance(loss, torch.Tensor) and loss.is_floating_point() and weight > 0:
            loss = loss.float()
            if loss.dim() == 0:
                if count is None:
                    return Loss(loss, 1, "mean"), loss, weight
                return Loss(loss, count, "count"), loss, weight
            if loss.dim() == 1 and len(loss) == samples and weight == samples:
                return Loss(loss, samples, "samples"), loss, samples
        shape = (
            f"a tensor of shape {tuple(loss.shape)} ({loss.dtype})"
            if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}"
        )
        raise StepError(
            f"step.factory: {self.name}.loss returned {shape} for a batch of {samples}; expected "
            f"a float tensor of one loss per sample (shape ({samples},)), a 0-d mean, or "
            "(0-d mean, samples)"
        )


class Weights:
    """How one optimizer step weighs its micro-batches' losses: each sample of the step (or
    item a ``(mean, count)`` loss counts) weighs ``1/N``, ``N`` the step's count over all its
    micro-batches and all ``W`` ranks; a 0-d mean without a count counts as one item, so each
    micro-batch weighs the same whatever its size, and each rank too.

    DDP averages the ranks' gradients, so a rank differentiates each micro-batch's total times
    ``W/N``. The micro-batches before the last differentiate ``total / reference`` instead,
    ``reference`` this rank's count where it is known before their backward passes (its
    samples, the step's micro-batches being drawn up front; ``group`` for 0-d means), else the
    first micro-batch's count times ``group``: a mean-like size either way, for fp16's scaler.
    Just before the synchronising backward, :meth:`last` multiplies the gradients they
    accumulated by ``reference * W / N`` (where that is not 1) and scales the last
    micro-batch's total by ``W/N``.

    ``N`` is known without a collective where every rank counts the same: one process,
    per-sample losses under an ``even`` sampler (``N = W x`` this rank's samples), 0-d means
    (``N = W x group``). Otherwise the ranks' counts are summed once per step: by the step's
    last agreement when ``carried`` (``training.skip_oom``: an all-reduce the step makes
    anyway), else by an asynchronous all-reduce of their own, posted as soon as this rank's
    count is known (after the first forward for per-sample losses, every micro-batch drawn up
    front; after the last forward for ``(mean, count)``) and waited for in :meth:`last`.
    Every rank's step must return the same kind of loss.

    A strategy whose unsynchronised gradients are not the parameters' ``.grad`` before the
    synchronising backward (FSDP keeps them unsharded, apart) does not ``reweigh``: where
    ``N`` is not known, every micro-batch differentiates its total over ``nominal`` (the same
    number on every rank), and :meth:`after` weighs the reduced gradients by
    ``nominal * W / N``.
    """

    def __init__(
        self,
        ctx: RunContext,
        group: int,
        name: str,
        *,
        even: bool,
        carried: bool,
        reweighs: bool = True,
        nominal: float = 1.0,
    ) -> None:
        self.ctx, self.group, self.name = ctx, group, name
        self.even, self.carried = even, carried
        self.reweighs, self.nominal = reweighs, nominal
        self._after: float | None = None
        self.samples = 0
        """This rank's samples in the step, counted before the first backward."""
        self.count = 0
        """This rank's count so far: samples, counted items, or micro-batches (0-d means)."""
        self.kind: Kind | None = None
        self.reference = 1.0
        self._added = 0
        self._total: Callable[[], torch.Tensor] | None = None

    @property
    def known(self) -> bool:
        """Whether the step's count over all ranks is ``W`` times this rank's, known without
        a collective."""
        same = self.kind == "mean" or (self.kind == "samples" and self.even)
        return same or not self.ctx.distributed

    def add(self, loss: Loss) -> None:
        """Count the next micro-batch's loss; once this rank's count is known, start summing
        the ranks' counts, unless no sum is needed or the agreement carries it.

        :raises StepError: when a micro-batch's loss is of another kind than the first's.
        """
        if self.kind is None:
            self.kind = loss.kind
            self.reference = self.samples if loss.kind == "samples" else loss.count * self.group
            if not self.reweighs and not self.known:  # the same on every rank: rescaled after
                self.reference = self.nominal
        elif loss.kind != self.kind:
            raise StepError(
                f"step.factory: {self.name}.loss returned {KIND_NAMES[loss.kind]} for a "
                f"micro-batch and {KIND_NAMES[self.kind]} for another of the same step; return "
                "one kind of loss for every batch"
            )
        self.count += loss.count
        self._added += 1
        if self.known or self.carried or self._total is not None:
            return
        if self.kind == "samples":
            self._total = sum_later(self.ctx, self.samples)
        elif self._added == self.group:
            self._total = sum_later(self.ctx, self.count)

    def local(self, loss: Loss) -> torch.Tensor:
        """What a micro-batch before the last differentiates: its total over the reference."""
        return loss.total / self.reference

    def summed(self, total: torch.Tensor) -> None:
        """Take the step's count over all ranks, as the agreement summed it (``carried``)."""
        self._total = lambda: total

    def last(self, loss: Loss, parameters: Iterable[nn.Parameter]) -> torch.Tensor:
        """What the last micro-batch differentiates, through DDP, once the gradients the others
        accumulated on this rank (of ``parameters``) are weighed by ``W/N``: waits for the
        ranks' sum where there is one (on CUDA the stream waits, not the host)."""
        per_rank: float | torch.Tensor = float(self.count)  # N / W
        exact = per_rank == self.reference  # the earlier micro-batches are weighed already
        if not self.known:
            assert self._total is not None
            summed = self._total() / self.ctx.world_size
            per_rank, exact = summed.to(self.ctx.device, torch.float32).reshape(()), False
        if not self.reweighs and not exact:
            self._after = float(self.reference / per_rank)  # a host sync, once a step
            return loss.total / self.reference
        if self.group > 1 and not exact:
            _scale([p.grad for p in parameters if p.grad is not None], self.reference / per_rank)
        elif self.group == 1 and exact:  # N / W is this micro-batch's count: its mean
            return loss.mean
        return loss.total / per_rank

    def after(self, parameters: Iterable[nn.Parameter]) -> None:
        """Once the synchronising backward is done, weigh the reduced gradients of
        ``parameters`` by ``reference * W / N``, where :meth:`last` could not weigh the
        accumulated ones before it (a strategy that does not ``reweigh``: every micro-batch
        then differentiates its total over a ``reference`` the same on every rank)."""
        if self._after is not None:
            _scale([p.grad for p in parameters if p.grad is not None], self._after)


def _scale(grads: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``factor``."""
    if grads:
        torch._foreach_mul_(grads, factor)


@attrs.define
class MicroBatches:
    """One optimizer step's micro-batches as it takes them: read from ``batches`` up front,
    their samples, how they are weighed, what each adds to the metrics, the last one's loss."""

    batches: Iterator[Any]
    weights: Weights
    drawn: list[Any] = attrs.Factory(list)
    samples: list[int] = attrs.Factory(list)
    """Each drawn micro-batch's samples (the step's ``batch_size``), once the first has run."""
    taken: list[Taken] = attrs.Factory(list)
    last: Loss | None = None


class Stepper:
    """Takes optimizer steps: forward and backward through ``ddp`` (or, for the micro-batches
    that accumulate locally, ``model``), then the update."""

    def __init__(
        self,
        *,
        ctx: RunContext,
        training: TrainingConfig,
        model: nn.Module,
        ddp: nn.Module,
        forward: Forward,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler | None,
        watchdog: Watchdog,
        even: bool,
        strategy: Strategy,
        local_passes: bool = True,
        guard: Guard | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        self.ctx, self.training, self.model, self.ddp = ctx, training, model, ddp
        self.guard = guard
        self.timer = timer or NoTimer()
        """Where this rank's step time goes (:mod:`~ups.core.observe._phases`)."""
        self.strategy, self.local_passes = strategy, local_passes
        self.parameters = list(model.parameters())
        """The model's parameters, listed once (a module's ``parameters()`` walks its tree)."""
        self.forward, self.optimizer, self.scheduler = forward, optimizer, scheduler
        self.watchdog = watchdog
        self.even = even
        """Whether every rank gets as many samples as the others (the training sampler's
        record says so): a step of per-sample losses then weighs them without a collective."""
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=training.precision == "fp16")
        self._number = 0
        self.attempts = 0
        """Steps begun (taken or skipped): what the watchdog and fault injection count."""
        self.oom_skipped = self.oom_in_a_row = 0
        agree = training.skip_oom
        if agree == "auto":
            agree = (ctx.device.type == "cuda" or not ctx.distributed) and local_passes
        self.agree = agree
        self._carried = self.agree and ctx.distributed
        """Whether a step's last agreement sums the ranks' counts (:class:`Weights`)."""
        self.bare = strategy.unsynced(ddp)
        """What micro-batches before a step's last run through: no gradient synchronisation."""

    def step(
        self, number: int, batches: Iterator[Any], group: int
    ) -> tuple[float, list[Taken]] | None:
        """Take optimizer step ``number``: forward and backward ``group`` micro-batches, each
        sample weighed the same over all of them and all ranks (:class:`Weights`), then
        update; return the gradient norm before clipping (NaN when neither clipping nor
        guarding) and what each micro-batch adds to the metrics, or ``None`` when every rank
        skipped the step: one ran out of memory. A step the guard finds bad raises its
        :class:`~ups.core.engine._guard.BadStep` signal on every rank, nothing applied.

        The step's micro-batches are drawn before the first forward. What fails before the
        synchronising backward (loading, forward passes, the local backward passes) is agreed
        on by every rank before any of them goes on: once before the last micro-batch's forward
        through DDP (which may hold collectives of its own), once after it. Each agreement is
        one all-reduce of a flag (the last one also summing the ranks' counts) when all went
        well.
        """
        t = self.training
        self._number = number
        self.attempts += 1
        self.watchdog.mark(self.attempts, STARTED)
        self.timer.enter(DATA)
        weights = Weights(
            self.ctx,
            group,
            self.forward.name,
            even=self.even,
            carried=self._carried,
            reweighs=self.strategy.reweighs,
            nominal=float(group * t.batch_size),
        )
        micro = MicroBatches(itertools.islice(batches, group), weights)
        try:
            if (group > 1 and not self._agreed(self._local_micro_batches, micro)) or (
                not self._agreed(self._synced_forward, micro, last=True)
            ):
                collections.deque(micro.batches, maxlen=0)  # read the rest: ranks stay in step
                self.timer.stop()
                return None
        except ConfigError as error:  # the step's or the data's: say at which step
            raise ConfigError(error.path, f"at step {number}: {error.problem}") from None
        except UsageError as error:
            raise type(error)(f"at step {number}: {error}") from None
        self.oom_in_a_row = 0
        self.watchdog.mark(self.attempts, BACKWARD)
        assert micro.last is not None
        self.timer.enter(COLLECTIVES)  # the ranks' count, if summed apart, is waited for
        last = weights.last(micro.last, self.parameters)
        self.timer.enter(BACKWARD_PHASE)
        self.scaler.scale(last).backward()  # type: ignore[no-untyped-call]
        self.timer.enter(OPTIMIZER)
        weights.after(self.parameters)
        grad_norm = self._grad_norm()
        guard = self.guard
        if guard is not None and (reason := guard.check(grad_norm)) is not None:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler.is_enabled():  # unscaled, not stepped: its scale kept as it is
                self.scaler.update(self.scaler.get_scale())
            self.timer.stop()
            # the signal of what every rank does, for the loop to record the step and do it
            guard.act(number, self.attempts, reason, [(m.loss, m.task_ids) for m in micro.taken])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and not is_plateau(self.scheduler):
            self.scheduler.step()  # a plateau scheduler steps after evaluations
        self.watchdog.mark(self.attempts, DONE)
        self.timer.stop()
        return grad_norm, micro.taken

    def _grad_norm(self) -> float:
        """The step's global gradient norm, the same on every rank, once unscaled: clipped to
        ``training.grad_clip_norm``, or, with the guard alone, measured (a host sync); NaN
        with neither."""
        clip = self.training.grad_clip_norm
        if clip is None and self.guard is None:
            return float("nan")
        self.scaler.unscale_(self.optimizer)
        if clip is not None:
            return self.strategy.clip_grad_norm(self.parameters, clip)
        return self.strategy.grad_norm(self.parameters)

    def backward_alone(self, batch: Any, *, sync: bool = False) -> None:
        """Forward and backward one batch, through DDP with ``sync``, else on this rank alone
        (gradients kept in ``.grad``, no collective)."""
        loss, _ = self.forward(self.ddp if sync else self.bare, batch)
        if sync:
            self.scaler.scale(loss.mean).backward()  # type: ignore[no-untyped-call]
        else:
            self.strategy.backward_unsynced(self.scaler.scale(loss.mean), self.model)

    def trial(self, batch: Any) -> None:
        """One optimizer step on ``batch`` (``ups tune``: does it fit?): on this rank alone,
        or, under a strategy that cannot pass a micro-batch without collectives (FSDP), on
        every rank together, synchronising as a step does."""
        self.backward_alone(batch, sync=not self.local_passes)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _agreed(
        self, work: Callable[[MicroBatches], None], micro: MicroBatches, *, last: bool = False
    ) -> bool:
        """Run ``work(micro)`` and tell whether every rank did it without failing; if one ran
        out of memory, every rank skips the step (``False``); any other failure is raised on
        every rank. A collective, with ``training.skip_oom`` on; else failures just raise.
        The ``last`` agreement of a step sums the ranks' counts too, for its :class:`Weights`."""
        if not self.agree:
            work(micro)
            return True
        summing = (lambda: micro.weights.count) if last and micro.weights.carried else None
        with Agreement(self.ctx, self._skip, summing=summing) as agreed:
            work(micro)
            self.timer.enter(COLLECTIVES)  # the agreement's all-reduce, as the block exits
        if agreed.total is not None:
            micro.weights.summed(agreed.total)
        return not agreed.failures

    def _local_micro_batches(self, micro: MicroBatches) -> None:
        """Draw the step's micro-batches, then forward and backward every one but the last,
        keeping their gradients on this rank: through the bare module, so no collective runs."""
        micro.drawn.extend(micro.batches)
        for index in range(len(micro.drawn) - 1):
            loss = micro.weights.local(self._pass(self.bare, micro, index))
            self.timer.enter(BACKWARD_PHASE)
            self.strategy.backward_unsynced(self.scaler.scale(loss), self.model)

    def _synced_forward(self, micro: MicroBatches) -> None:
        """Forward the step's last micro-batch through DDP (drawn here, inside the step's only
        agreement, when it is the only one); its backward synchronises."""
        if not micro.drawn:
            micro.drawn.extend(micro.batches)
        micro.last = self._pass(self.ddp, micro, len(micro.drawn) - 1)

    def _pass(self, module: nn.Module, micro: MicroBatches, index: int) -> Loss:
        """The step's drawn micro-batch ``index`` through ``module``: its loss, counted by the
        step's weights, and what it adds to the metrics. After the first, the others' samples
        are counted, so that this rank's count is known before the first backward (the first
        is counted on the device, after the move that names a batch it cannot move)."""
        self.timer.enter(FORWARD_PHASE)
        batch = micro.drawn[index]
        loss, taken = self.forward(module, batch, micro.samples[index] if index else None)
        if not index:
            others = map(self.forward.step.batch_size, micro.drawn[1:])
            micro.samples = [taken.samples, *others]
            micro.weights.samples = sum(micro.samples)
        micro.taken.append(taken)
        micro.weights.add(loss)
        return loss

    def _skip(self, failures: list[Failure], error: Exception | None) -> Exception | None:
        """Skip the step on every rank if ranks only ran out of memory (and not too often in a
        row); else what every rank raises (:class:`~ups.core.dist._collectives.Agreement`): a failed
        rank its own error, the others a :class:`RankFailedError` naming the first rank that
        failed and how."""
        step = self._number
        crashed = [f for f in failures if not f.out_of_memory]
        if crashed:
            if error is not None and not Failure.of(self.ctx.rank, error).out_of_memory:
                return error
            return RankFailedError.naming(f"step {step}: {crashed[0]}", crashed[0])
        self.oom_skipped += 1
        self.oom_in_a_row += 1
        ranks = [f.rank for f in failures]
        limit = self.training.max_oom_skips
        if self.oom_in_a_row > limit:
            return RankFailedError(
                f"step {step}: out of memory on rank {', '.join(map(str, ranks))} "
                f"{self.oom_in_a_row} times in a row (training.max_oom_skips: {limit}); "
                "lower training.batch_size (`ups tune` finds the largest that fits)"
            )
        if self.ctx.is_main:
            log.warning("out of memory: every rank skips the batch", step=step, ranks=ranks)
        if error is not None:
            # Its traceback holds the failed passes' frames and their tensors, in a cycle with
            # the frame that caught it: freed now, not when the garbage collector gets to it,
            # so that emptying the cache below hands their memory back.
            error.__traceback__ = None
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        return None
