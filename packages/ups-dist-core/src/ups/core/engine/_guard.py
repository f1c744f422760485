"""The training guard (``training.guard``): what every rank does, together, when an optimizer
step goes bad, decided with no collective of its own.

The signal is the step's global gradient norm, taken after the synchronising backward: DDP has
averaged the gradients, so every rank holds the same ones and computes the same norm (the norm
clipping takes, or :meth:`~ups.core.engine._strategy.Strategy.grad_norm`'s), and the same
arithmetic on it gives every rank the same verdict. A loss that is not finite on one rank makes
the averaged gradients, and so the norm, not finite on every rank. A step is bad when its norm
is not finite, or (``spike``) over ``spike`` times the running average of the accepted steps'
norms, once ``warmup_steps`` were accepted. Under fp16 the gradient scaler skips the steps whose
gradients are not finite already: the guard leaves them to it and counts them.

Only once a step is bad do the ranks tell each other more (one ``all_gather_object``): whose
loss was not finite, and the tasks of their batches, for the message a stop raises.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import structlog
import torch
import torch.distributed as dist

from ..config._config import GuardConfig
from ..dist._context import RunContext
from ._step import StepError

log = structlog.get_logger()

DECAY = 0.98
"""The running average's decay: ``average = DECAY * average + (1 - DECAY) * norm`` for each
accepted step (about the last 50 steps), the first accepted norm to start."""


class GuardStoppedError(StepError):
    """The guard stopped the run (``training.guard``): raised on every rank, the same line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def at(self, epoch: int, first: int, last: int) -> GuardStoppedError:
        """This error, naming the step's batches: ``first`` to ``last`` of each rank's share
        of epoch ``epoch`` (counted from 1)."""
        batches = f"batch {last}" if first == last else f"batches {first}-{last}"
        return GuardStoppedError(
            f"{self.message}; epoch {epoch}, {batches} of each rank's share (the engine does "
            "not know their sample indices)"
        )


class Guard:
    """One rank's guard: :meth:`check` each step's global gradient norm, :meth:`act` on a bad
    one. ``tasks``: ``data.tasks``, to name task ids; ``scaled``: fp16's gradient scaler is on."""

    def __init__(
        self, config: GuardConfig, ctx: RunContext, *, tasks: Sequence[str] = (), scaled: bool
    ) -> None:
        self.config, self.ctx, self.tasks, self.scaled = config, ctx, tasks, scaled
        self.skipped = 0
        """Steps the guard skipped (reported as ``guard_skipped``)."""
        self.overflows = 0
        """Steps whose norm was not finite under fp16, left to the scaler to skip
        (``scaler_skipped``)."""
        self.accepted = 0
        self.average = 0.0
        """The running average of the accepted steps' norms."""
        self._skips: collections.deque[int] = collections.deque()
        """The attempts skipped within the last ``window``."""

    def check(self, norm: float) -> str | None:
        """Why a step whose global gradient norm is ``norm`` is bad, or ``None`` (its norm then
        joins the running average): the same on every rank, given the same norm."""
        if not math.isfinite(norm):
            if self.scaled:
                self.overflows += 1
                return None
            return f"the gradient norm is {norm} (not finite)"
        spike, accepted = self.config.spike, self.accepted
        warm = accepted >= self.config.warmup_steps
        if spike is not None and warm and norm > spike * self.average:
            return (
                f"the gradient norm {norm:.4g} is over training.guard.spike: {spike:g} "
                f"times its running average {self.average:.4g}"
            )
        self.average = DECAY * self.average + (1 - DECAY) * norm if accepted else norm
        self.accepted = accepted + 1
        return None

    def act(
        self,
        step: int,
        attempt: int,
        reason: str,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    ) -> None:
        """Act on bad step ``step`` (the ``attempt``-th begun) on every rank together: count and
        log a skip (return), or raise.

        :param batches: each micro-batch's losses and task ids on this rank.
        :raises GuardStoppedError: with ``stop``, or past the budget of skips: naming the
            step, the ranks whose loss was not finite and the tasks (gathered from every rank:
            a collective, every rank raising the same).
        """
        c = self.config
        cause = "training.guard.action: stop"
        if c.action == "skip":
            skips = self._skips
            skips.append(attempt)
            while skips[0] <= attempt - c.window:
                skips.popleft()
            if len(skips) <= c.max_skips:
                self.skipped += 1
                if self.ctx.is_main:
                    log.warning("guard: every rank skips the step", step=step, reason=reason)
                return
            cause = (
                f"{len(skips)} bad steps in the last {c.window}, over "
                f"training.guard.max_skips: {c.max_skips}"
            )
        raise GuardStoppedError(f"step {step}: {reason} ({cause}); {self._gathered(batches)}")

    def _gathered(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> str:
        """Whose loss was not finite, and the tasks of the step's batches, over every rank."""
        finite = all(bool(torch.isfinite(loss).all()) for loss, _ in batches)
        ids = {
            int(i)
            for _, task_ids in batches
            if task_ids is not None
            for i in torch.unique(task_ids)
        }
        mine = (finite, ids)
        gathered: list[tuple[bool, set[int]]] = [mine]
        if self.ctx.distributed:
            gathered = [mine] * self.ctx.world_size
            dist.all_gather_object(gathered, mine)
        ranks = [str(rank) for rank, (ok, _) in enumerate(gathered) if not ok]
        said = "the loss was finite on every rank"
        if ranks:
            said = f"the loss was not finite on rank {', '.join(ranks)}"
        tasks = sorted(set().union(*(ids for _, ids in gathered)))
        if tasks:
            named = (self.tasks[i] if 0 <= i < len(self.tasks) else str(i) for i in tasks)
            said += f"; tasks {', '.join(named)}"
        return said
