"""The optimizer step: micro-batches through the user's :class:`~ups.core.Step`, forward and
backward, then one update.

Each optimizer step takes ``training.accumulation_steps`` micro-batches; gradients are
synchronised across ranks on the last one only (the others accumulate on each rank, through the
bare module), unscaled once (fp16), clipped once to a global norm that is the same number on
every rank, then applied. What fails before the synchronising backward is agreed on by every
rank (``training.skip_oom``): out of memory skips the step everywhere, anything else stops
every rank naming the one that failed.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import typing
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .batches import to_device
from .collectives import Failure, RankFailedError, gather_failures
from .config import TrainingConfig
from .context import RunContext
from .errors import ConfigError, UsageError
from .metrics import LossWindow
from .step import Step, StepError, _raw
from .user_metrics import UserMetrics
from .watchdog import BACKWARD, DONE, STARTED, Watchdog

log = structlog.get_logger()

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    ``watchdog`` is told which user code runs, by the config key naming it: a step's own
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
    ) -> None:
        self.step, self.ctx, self.metrics, self.watchdog = step, ctx, metrics, watchdog
        self._precision, self._non_blocking = precision, pinned and ctx.device.type == "cuda"
        self._name = type(step).__qualname__
        own_forward = type(step).forward is not Step.forward
        own_loss = type(step).loss is not Step.loss or callable(_raw(step, "criterion"))
        self._forward_key = f"step.factory ({self._name}.forward)" if own_forward else None
        self._loss_key = f"step.factory ({self._name}.loss)" if own_loss else None

    def __call__(self, module: nn.Module, batch: Any) -> tuple[torch.Tensor, Taken]:
        """The micro-batch's mean loss (to differentiate) and what it adds to the metrics."""
        step = self.step
        batch = to_device(batch, self.ctx.device, non_blocking=self._non_blocking)
        with self.autocast():
            with self.watchdog.calling(self._forward_key):
                outputs = step.forward(module, batch)
            with self.watchdog.calling(self._loss_key):
                returned = step.loss(outputs, batch)
        samples = step.batch_size(batch)
        mean, loss, weight = self._checked(returned, samples)
        with torch.no_grad(), self.watchdog.calling(self.metrics.key):
            values = self.metrics.check(step.metrics(outputs, batch), samples)
        return mean, Taken(loss.detach(), samples, step.task_ids(batch), values, weight)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast (none for fp32)."""
        if self._precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=AUTOCAST_DTYPES[self._precision])

    def _checked(self, returned: Any, samples: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The mean loss, the per-sample (or mean) loss to count, and what a mean counts for,
        from what ``loss`` gave.

        :raises StepError: naming the step's ``loss`` and what it should have returned.
        """
        loss, count = returned, samples
        if isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[1], int):
            loss, count = returned
        if isinstance(loss, torch.Tensor) and loss.is_floating_point() and count > 0:
            if loss.dim() == 0:
                return loss.float(), loss.float(), count
            if loss.dim() == 1 and len(loss) == samples and count == samples:
                loss = loss.float()
                return loss.mean(), loss, samples
        shape = (
            f"a tensor of shape {tuple(loss.shape)} ({loss.dtype})"
            if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}"
        )
        raise StepError(
            f"step.factory: {self._name}.loss returned {shape} for a batch of {samples}; expected "
            f"a float tensor of one loss per sample (shape ({samples},)), a 0-d mean, or "
            "(0-d mean, samples)"
        )


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
        scheduler: Any,
        watchdog: Watchdog,
    ) -> None:
        self.ctx, self.training, self.model, self.ddp = ctx, training, model, ddp
        self.forward, self.optimizer, self.scheduler = forward, optimizer, scheduler
        self.watchdog = watchdog
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=training.precision == "fp16")
        self._number = 0
        self.attempts = 0
        """Steps begun (taken or skipped): what the watchdog and fault injection count."""
        self.oom_skipped = self.oom_in_a_row = 0
        agree = training.skip_oom
        self.agree = (
            (ctx.device.type == "cuda" or not ctx.distributed) if agree == "auto" else agree
        )
        self._local = isinstance(ddp, DistributedDataParallel)

    @property
    def bare(self) -> nn.Module:
        """The module without DDP's wrapper: its passes run no collective."""
        return typing.cast(nn.Module, self.ddp.module) if self._local else self.ddp

    def step(
        self, number: int, batches: Iterator[Any], group: int
    ) -> tuple[float, list[Taken]] | None:
        """Take optimizer step ``number``: forward and backward ``group`` micro-batches, then
        update; return the
        gradient norm before clipping (NaN when not clipping) and what each micro-batch adds
        to the metrics, or ``None`` when every rank skipped the step because one ran out of
        memory.

        What fails before the synchronising backward (loading, forward passes, the local
        backward passes) is agreed on by every rank before any of them goes on: once before the
        last micro-batch's forward through DDP (which may hold collectives of its own), once
        after it. Each agreement is one all-reduce of a flag when all went well.
        """
        t = self.training
        self._number = number
        self.attempts += 1
        self.watchdog.mark(self.attempts, STARTED)
        micro_batches = itertools.islice(batches, group)
        taken: list[Taken] = []
        losses: list[torch.Tensor] = []
        try:
            if (
                group > 1
                and not self._agreed(self._local_micro_batches, micro_batches, group, taken)
            ) or not self._agreed(self._synced_forward, micro_batches, group, taken, losses):
                collections.deque(micro_batches, maxlen=0)  # read the rest: ranks stay in step
                return None
        except ConfigError as error:  # the step's or the data's: say at which step
            raise ConfigError(error.path, f"at step {number}: {error.problem}") from None
        except UsageError as error:
            raise type(error)(f"at step {number}: {error}") from None
        self.oom_in_a_row = 0
        self.watchdog.mark(self.attempts, BACKWARD)
        losses[0].backward()  # type: ignore[no-untyped-call]
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
        return grad_norm, taken

    def backward_alone(self, batch: Any, *, sync: bool = False) -> None:
        """Forward and backward one batch, through DDP with ``sync``, else on this rank alone
        (gradients kept in ``.grad``, no collective)."""
        loss, _ = self.forward(self.ddp if sync else self.bare, batch)
        if self._local and not sync:
            self._accumulate_locally(self.scaler.scale(loss))
        else:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]

    def trial(self, batch: Any) -> None:
        """One optimizer step on ``batch`` on this rank alone (``ups tune``: does it fit?)."""
        self.backward_alone(batch)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

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
        self, micro_batches: Iterator[Any], group: int, taken: list[Taken]
    ) -> None:
        """Forward and backward every micro-batch of the step but the last, keeping their
        gradients on this rank: through the bare module, so no collective runs."""
        for batch in itertools.islice(micro_batches, group - 1):
            loss, counted = self.forward(self.bare, batch)
            taken.append(counted)
            scaled = self.scaler.scale(loss / group)
            if self._local:
                self._accumulate_locally(scaled)
            else:
                scaled.backward()  # type: ignore[no-untyped-call]

    def _synced_forward(
        self,
        micro_batches: Iterator[Any],
        group: int,
        taken: list[Taken],
        losses: list[torch.Tensor],
    ) -> None:
        """Forward the step's last micro-batch through DDP; its backward synchronises."""
        loss, counted = self.forward(self.ddp, next(micro_batches))
        taken.append(counted)
        losses.append(self.scaler.scale(loss / group))

    def _skip(self, failures: list[Failure], error: Exception | None) -> None:
        """Skip the step on every rank if ranks only ran out of memory (and not too often in a
        row); else raise on every rank: a failed rank its own error, the others a
        :class:`RankFailedError` naming the first rank that failed and how."""
        step = self._number
        crashed = [f for f in failures if not f.out_of_memory]
        if crashed:
            if error is not None and not Failure(0, type(error).__name__, str(error)).out_of_memory:
                raise error
            raise RankFailedError(f"step {step}: {crashed[0]}")
        self.oom_skipped += 1
        self.oom_in_a_row += 1
        ranks = [f.rank for f in failures]
        limit = self.training.max_oom_skips
        if self.oom_in_a_row > limit:
            raise RankFailedError(
                f"step {step}: out of memory on rank {', '.join(map(str, ranks))} "
                f"{self.oom_in_a_row} times in a row (training.max_oom_skips: {limit}); "
                "lower training.batch_size (`ups tune` finds the largest that fits)"
            ) from error
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
