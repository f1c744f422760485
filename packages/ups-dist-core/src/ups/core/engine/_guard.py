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
loss was not finite, the tasks of their batches and their sample indices, for the record of the
step (:meth:`Guard.record`), whatever the action: appended to ``guard.jsonl`` in the run folder
(which a resumed run, or a later run's ``quarantine``, reads: :class:`Quarantine`) and handed
to the ``ups_guard_record`` hook on rank 0, before a stop's error propagates.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

import structlog
import torch
import torch.distributed as dist

from ..config._config import GuardConfig
from ..config._errors import ConfigError
from ..config._structure import structure
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

    def at(
        self, epoch: int, first: int, last: int, indices: Sequence[Sequence[int]]
    ) -> GuardStoppedError:
        """This error, naming the step's batches: ``first`` to ``last`` of each rank's share
        of epoch ``epoch`` (counted from 1), and their sample indices, each rank's (the first
        :data:`SHOWN` of each)."""
        batches = f"batch {last}" if first == last else f"batches {first}-{last}"
        samples = "; ".join(
            f"rank {rank} {_shown(drawn)}" for rank, drawn in enumerate(indices) if drawn
        )
        return GuardStoppedError(
            f"{self.message}; epoch {epoch}, {batches} of each rank's share; samples: {samples}"
        )


SHOWN = 8
"""The sample indices a stop's message names per rank."""


def _shown(indices: Sequence[int]) -> str:
    more = f" and {len(indices) - SHOWN} more" if len(indices) > SHOWN else ""
    return f"[{', '.join(map(str, indices[:SHOWN]))}]{more}"


class BadStep(Exception):  # noqa: N818 (a signal to the loop, not an error)
    """The guard acts on bad step ``step``: raised on every rank by :meth:`Guard.act`, for the
    loop to record the step (:meth:`Guard.record`) and do what :attr:`action` says."""

    action: ClassVar[Literal["skip", "rollback", "stop"]]

    def __init__(self, step: int, reason: str, mine: tuple[bool, list[int]]) -> None:
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason, self.mine = step, reason, mine
        """``mine``: whether this rank's losses were finite, and its batches' task ids."""


class Skipping(BadStep):
    """Every rank skips the step (``training.guard.action: skip``, within ``max_skips``)."""

    action = "skip"


class RollingBack(BadStep):
    """Every rank rolls back (``training.guard.action: rollback``, within ``max_rollbacks``):
    the loop restores its snapshot."""

    action = "rollback"


class Stopping(BadStep):
    """Every rank stops (``training.guard.action: stop``, or past the budget of skips or
    rollbacks): the loop raises :meth:`error` once the step is recorded."""

    action = "stop"

    def __init__(self, step: int, reason: str, mine: tuple[bool, list[int]], cause: str) -> None:
        super().__init__(step, f"{reason} ({cause})", mine)

    def error(self, said: str) -> GuardStoppedError:
        """The error every rank raises, ``said`` naming the ranks and tasks (:meth:`Guard.said`)."""
        return GuardStoppedError(f"step {self.step}: {self.reason}; {said}")


FILE = "guard.jsonl"
"""The guard's records in the run folder: one bad global step a line (:meth:`Guard.record`),
the quarantine of a resumed run and of a later one's ``quarantine``."""

WHAT = {
    "skip": "guard: every rank skips the step",
    "rollback": "guard: every rank rolls back, the step quarantined",
    "stop": "guard: every rank stops",
}
"""Rank 0's log line on a bad step, by action."""


class Quarantine:
    """The global steps every rank passes over, by ``(epoch, first batch)`` (both counted from
    1, the batch in each rank's share of the epoch): a rollback's, and those of the
    ``guard.jsonl`` files read."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], bool] = {}
        """The steps held, each with whether passing over it cuts the LR
        (``training.guard.lr_factor``)."""

    def read(self, path: Path, key: str, *, own: bool = False) -> None:
        """Hold the steps that the ``guard.jsonl`` at ``path`` names (a missing file: none).
        ``own``: the run's own file, read on resuming: a step it skipped is passed over as the
        skip did, with no LR cut (every other step of a file cuts it, as a rollback's does).

        :raises ConfigError: naming ``key`` for a line that is not a step of a ``guard.jsonl``.
        """
        if not path.is_file():
            return
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
                step = (int(record["epoch"]), int(record["batches"][0]))
            except (ValueError, KeyError, TypeError, IndexError):
                raise ConfigError(
                    key, f"line {number} of {path} is not a step of a guard.jsonl"
                ) from None
            self.held[step] = not (own and record.get("action") == "skip")

    def hold(self, epoch: int, first: int) -> None:
        """Hold the step whose first batch is ``first`` of epoch ``epoch`` (a rollback's),
        passing over it cutting the LR."""
        self.held[epoch, first] = True

    def holds(self, epoch: int, first: int) -> bool:
        """Whether the step whose first batch is ``first`` of epoch ``epoch`` is quarantined."""
        return (epoch, first) in self.held

    def cuts(self, epoch: int, first: int) -> bool:
        """Whether passing over that quarantined step cuts the LR."""
        return self.held[epoch, first]


class Guard:
    """One rank's guard: :meth:`check` each step's global gradient norm, :meth:`act` on a bad
    one, and :meth:`record` it (the run's loop). ``tasks``: ``data.tasks``, to name task ids;
    ``scaled``: fp16's gradient scaler is on."""

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
        """The attempts skipped (or rolled back from) within the last ``window``."""
        self.rollbacks = 0
        """Rollbacks taken (reported as ``guard_rollbacks``)."""
        self.cut_left = 0
        """Optimizer steps the LR is still cut by ``lr_factor`` for."""
        self._attempts = 0
        """Steps :meth:`verdict` was asked about (a loop of one's own)."""

    @classmethod
    def in_loop(cls, ctx: RunContext, **options: Any) -> Guard:
        """A guard for a loop of one's own, with the options ``training.guard`` takes
        (``action``, ``spike``, ``warmup_steps``, ``max_skips``, ``max_rollbacks``, ``window``);
        ask it for each step's :meth:`verdict`.

        :raises ConfigError: naming an option it does not take, or a value it refuses.
        """
        return cls(structure(GuardConfig, options, "options"), ctx, scaled=False)

    def verdict(self, loss: torch.Tensor, grad_norm: float) -> Literal["step", "skip", "rollback"]:
        """What every rank does with the step whose loss on this rank is ``loss`` and whose
        global gradient norm (after the gradients' all-reduce: the same on every rank) is
        ``grad_norm``: ``step`` (take it), ``skip`` (zero the gradients, no update) or
        ``rollback`` (restore your copy of the state from before it, and pass over its
        batches); the same answer on every rank, with no collective unless the step is bad.

        :raises GuardStoppedError: on every rank, with ``action: stop`` or past the budget:
            naming the step and the ranks whose loss was not finite.
        """
        self._attempts += 1
        reason = self.check(grad_norm)
        if reason is None:
            return "step"
        try:
            self.act(self._attempts, self._attempts, reason, [(loss.detach().reshape(-1), None)])
        except Skipping as skipping:
            self._log(skipping)
            return "skip"
        except RollingBack as rolling:
            self._log(rolling)
            return "rollback"
        except Stopping as stopping:
            raise stopping.error(self.said(gathered(self.ctx, stopping.mine))) from None

    def state(self) -> tuple[float, int, int]:
        """What a snapshot keeps of the guard: the running average, its steps, the LR cut's."""
        return self.average, self.accepted, self.cut_left

    def load_state(self, state: tuple[float, int, int]) -> None:
        """Go back to what :meth:`state` gave."""
        self.average, self.accepted, self.cut_left = state

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
    ) -> NoReturn:
        """Act on bad step ``step`` (the ``attempt``-th begun) on every rank together, with no
        collective: count a skip or a rollback within its budget, and raise the signal for
        what every rank does.

        :param batches: each micro-batch's losses and task ids on this rank.
        :raises Skipping: with ``skip``, within ``max_skips``.
        :raises RollingBack: with ``rollback``, within ``max_rollbacks``.
        :raises Stopping: with ``stop``, or past the budget of skips or rollbacks.
        """
        c = self.config
        cause = "training.guard.action: stop"
        mine = _own(batches)
        if c.action != "stop":
            skips = self._skips
            skips.append(attempt)
            while skips[0] <= attempt - c.window:
                skips.popleft()
            budget, name = (
                (c.max_skips, "max_skips")
                if c.action == "skip"
                else (c.max_rollbacks, "max_rollbacks")
            )
            if len(skips) <= budget and c.action == "rollback":
                self.rollbacks += 1
                raise RollingBack(step, reason, mine)
            if len(skips) <= budget:
                self.skipped += 1
                raise Skipping(step, reason, mine)
            cause = f"{len(skips)} bad steps in the last {c.window}, over training.guard.{name}: {budget}"
        raise Stopping(step, reason, mine, cause)

    def record(
        self,
        bad: BadStep,
        epoch: int,
        first: int,
        indices: Sequence[Sequence[int]],
        folder: Path,
        tell: Callable[[Mapping[str, Any]], None],
    ) -> dict[str, Any]:
        """Record the bad step ``bad`` names, its batches ``first`` on of epoch ``epoch`` (both
        counted from 1) and this rank's sample ``indices`` of each, gathered over every rank
        (one collective, every rank together): rank 0 appends the record to
        ``folder/guard.jsonl``, logs it and hands it to ``tell`` (the ``ups_guard_record``
        hook). The record: ``{step, epoch, batches: [first, last], action, reason, ranks:
        [{rank, finite, tasks, indices}]}``.

        :raises GuardStoppedError: on every rank, after the record, when ``bad`` is a stop:
            naming the step, the ranks whose loss was not finite, the tasks, the batches and
            their samples.
        """
        finite, ids = bad.mine
        every = gathered(self.ctx, (finite, ids, [i for batch in indices for i in batch]))
        last = first + len(indices) - 1
        record = {
            "step": bad.step,
            "epoch": epoch,
            "batches": [first, last],
            "action": bad.action,
            "reason": bad.reason,
            "ranks": [
                {
                    "rank": rank,
                    "finite": ok,
                    "tasks": [self._task(i) for i in tasks],
                    "indices": drawn,
                }
                for rank, (ok, tasks, drawn) in enumerate(every)
            ],
        }
        said = self.said(every)
        if self.ctx.is_main:
            with (folder / FILE).open("a") as file:
                file.write(json.dumps(record) + "\n")
            self._log(bad, epoch=epoch, batches=record["batches"], said=said)
            tell(record)
        if isinstance(bad, Stopping):
            drawn = [drawn for _, _, drawn in every]
            raise bad.error(said).at(epoch, first, last, drawn) from None
        return record

    def _log(self, bad: BadStep, **more: Any) -> None:
        """Rank 0's line on the bad step ``bad``, with ``more`` (the record's place)."""
        if self.ctx.is_main:
            log.warning(WHAT[bad.action], step=bad.step, reason=bad.reason, **more)

    def _task(self, task_id: int) -> str:
        return self.tasks[task_id] if 0 <= task_id < len(self.tasks) else str(task_id)

    def said(self, gathered: Sequence[tuple[Any, ...]]) -> str:
        """Whose loss was not finite, and the tasks of the step's batches, over every rank."""
        ranks = [str(rank) for rank, (ok, *_) in enumerate(gathered) if not ok]
        said = "the loss was finite on every rank"
        if ranks:
            said = f"the loss was not finite on rank {', '.join(ranks)}"
        tasks = sorted(set().union(*(ids for _, ids, *_ in gathered)))
        if tasks:
            said += f"; tasks {', '.join(map(self._task, tasks))}"
        return said


def gathered(ctx: RunContext, mine: Any) -> list[Any]:
    """``mine`` from every rank, in rank order (one ``all_gather_object``): what the ranks tell
    each other once the guard has fired, never before."""
    if not ctx.distributed:
        return [mine]
    every = [mine] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every


def _own(batches: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[bool, list[int]]:
    """Whether this rank's losses of a step were all finite, and its batches' task ids."""
    finite = all(bool(torch.isfinite(loss).all()) for loss, _ in batches)
    ids = {
        int(i) for _, task_ids in batches if task_ids is not None for i in torch.unique(task_ids)
    }
    return finite, sorted(ids)
