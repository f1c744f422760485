"""Small collectives the engine and plugins build on: decide once, act everywhere.

Seed 000's rule: one rank decides, every rank receives the same decision, every rank acts on it.
Never let rank 0 alone act on a decision the others must share, and never let rank 0 alone
enter a collective (it deadlocks).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist

from ._context import RunContext
from ..config._errors import UsageError

T = TypeVar("T")


class RankFailedError(RuntimeError):
    """Raised on the ranks that did not fail when another rank failed what every rank does
    (:func:`decide`, a step agreed by :func:`gather_failures`); names that rank and its error.
    Where that error was a :class:`~ups.core.UsageError` (bad input every rank shares), it is
    a :class:`RankUsageError`: the command line exits 2 on every rank."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        """The rank that failed and how, where the error is about one rank's failure."""

    @classmethod
    def naming(cls, message: str, failure: Failure) -> RankFailedError:
        """The error saying ``message`` about ``failure``: a :class:`RankUsageError` where
        ``failure`` was a usage error."""
        return (RankUsageError if failure.usage else RankFailedError)(message, failure)


class RankUsageError(RankFailedError, UsageError):
    """A :class:`RankFailedError` for another rank's usage error: ranks that were told of bad
    input exit as the rank that found it does (status 2 from the command line)."""


def decide(
    ctx: RunContext, decision: Callable[[], T], *, group: dist.ProcessGroup | None = None
) -> T:
    """Run ``decision`` on rank 0 and return its (picklable) result on every rank.

    If it raises on rank 0, rank 0 raises that error (as without a process group) and every
    other rank a :class:`RankFailedError` with rank 0's message, so no rank is left waiting in
    a later collective. Every rank must call this. ``group``: the process group to talk over
    (every rank of the job is in it); ``None``: the default.
    """
    if not ctx.distributed:
        return decision()
    payload: list[object] = [None]
    failed = None
    if ctx.is_main:
        try:
            payload[0] = ("ok", decision())
        except Exception as error:
            failed = error
            payload[0] = ("error", Failure.of(0, error))
    dist.broadcast_object_list(payload, src=0, group=group, device=_object_device(ctx, group))
    if failed is not None:
        raise failed
    status, value = typing.cast(tuple[str, Any], payload[0])
    if status == "error":
        raise _failed(value)
    return typing.cast(T, value)


def _failed(failure: Failure) -> RankFailedError:
    """The error a rank raises for another rank's ``failure``: it names that rank and error."""
    return RankFailedError.naming(
        f"rank {failure.rank} failed: {failure.kind}: {failure.message}", failure
    )


@attrs.frozen
class Failure:
    """How one rank failed a step that every rank took."""

    rank: int
    kind: str
    """The exception's class name."""
    message: str
    usage: bool = False
    """Whether the exception was a :class:`~ups.core.UsageError`: bad input, not a fault."""

    @classmethod
    def of(cls, rank: int, error: BaseException) -> Failure:
        """How ``error`` failed ``rank``."""
        return cls(rank, type(error).__name__, str(error), isinstance(error, UsageError))

    @property
    def out_of_memory(self) -> bool:
        """Whether the rank ran out of (device) memory: a ``torch.OutOfMemoryError``, or the
        ``RuntimeError`` older CUDA builds raise."""
        return self.kind == "OutOfMemoryError" or "out of memory" in self.message

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


def gather_failures(
    ctx: RunContext, error: BaseException | None, *, group: dist.ProcessGroup | None = None
) -> list[Failure]:
    """Tell every rank which ranks failed a step: each passes its exception, or ``None``.

    Returns the same list on every rank (empty when none failed), so every rank can raise, or
    go on, together. A collective: every rank calls it, failed or not. When no rank failed it
    costs one all-reduce of one number; the messages are gathered only when one did.
    """
    return _gather(ctx, error, group, None)[0]


Raising = Callable[[list[Failure], Exception | None], BaseException | None]
"""What an :class:`Agreement` raises on a rank, given every rank's failure (never empty) and
this rank's own error (``None``: this rank did not fail): the error to raise (this rank's own
error, re-raised as it is, or another, raised from it), or ``None`` to go on together (the
failures were tolerated, as a step that ran out of memory is skipped)."""


def first_failure(rank: int) -> Raising:
    """An :class:`Agreement`'s ``raising`` for work every rank does alike (building from the
    config): the lowest rank that failed raises its own error, every other rank (failed too or
    not) an error naming it, a :class:`RankUsageError` where it was bad input. So ranks that
    fail alike are reported as the lowest rank's error whichever of them exits first, and
    ``rank`` is this rank."""

    def raising(failures: list[Failure], error: Exception | None) -> BaseException:
        first = min(failures, key=lambda failure: failure.rank)
        return error if error is not None and first.rank == rank else _failed(first)

    return raising


class Agreement:
    """Runs a block on every rank and tells every rank whether it failed on any; if it did,
    every rank raises together: ``with Agreement(ctx, raising): work()``.

    The one place of the idiom "run, catch, :func:`gather_failures`, raise on every rank": a
    rank's exception (an ``Exception``; others, such as ``KeyboardInterrupt``, pass at once)
    leaves the block, every rank's failures are gathered as it exits, and ``raising`` says
    what each rank raises. A collective over ``group`` (``None``: the default group): every
    rank runs the block, failed or not. When no rank failed it costs one all-reduce of one
    number, which also sums what every rank's ``summing`` gives as the block exits, where one
    is given (a sum the ranks need anyway rides the agreement, at no collective of its own).
    """

    def __init__(
        self,
        ctx: RunContext,
        raising: Raising,
        *,
        group: dist.ProcessGroup | None = None,
        summing: Callable[[], float] | None = None,
    ) -> None:
        self.ctx = ctx
        self.raising = raising
        self.group = group
        self.summing = summing
        self.failures: list[Failure] = []
        """Every rank's failure, the same on every rank, once the block has run (where the
        block went on, the failures ``raising`` tolerated)."""
        self.total: torch.Tensor | None = None
        """The sum of what every rank's ``summing`` gave, once the block has run (``None``
        without one): a float64 tensor of one element on the device collectives use, not read
        on the host."""

    def __enter__(self) -> Agreement:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: object
    ) -> bool:
        del traceback  # held by ``error`` alone: ``raising`` may drop its frames' memory
        if error is not None and not isinstance(error, Exception):
            return False  # an interrupt: no rank waits for a rank that is going away
        value = None if self.summing is None else self.summing()
        self.failures, self.total = _gather(self.ctx, error, self.group, value)
        if not self.failures:
            return False
        raised = self.raising(self.failures, error)
        if raised is None:
            return True  # tolerated: every rank goes on
        if raised is error:
            return False  # this rank's own error, as it is
        raise raised from error


def _gather(
    ctx: RunContext,
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    value: float | None,
) -> tuple[list[Failure], torch.Tensor | None]:
    """The failures, and the sum of ``value`` over the ranks (``None`` without a value)."""
    mine = None if error is None else Failure.of(ctx.rank, error)
    if not ctx.distributed:
        total = None if value is None else torch.full((1,), value, dtype=torch.float64)
        return [mine] if mine is not None else [], total
    device = _object_device(ctx, group) or torch.device("cpu")
    numbers = [float(mine is not None)] + ([] if value is None else [value])
    summed = torch.tensor(numbers, dtype=torch.float64, device=device)
    total = None if value is None else summed[1:]
    dist.all_reduce(summed, group=group)  # the failed ranks counted, and the values summed
    if not summed[0].item():
        return [], total
    gathered: list[Failure | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine, group=group)
    return [f for f in gathered if f is not None], total


def sum_later(ctx: RunContext, value: float) -> Callable[[], torch.Tensor]:
    """Start summing every rank's ``value`` with an asynchronous all-reduce, which what runs
    until the wait overlaps; return the wait, which gives the sum: a float64 tensor of one
    element on the device collectives use. On CUDA (NCCL) the wait orders the current stream
    after the all-reduce; the host does not wait. A collective: every rank calls it. Not
    distributed: ``value`` itself, at once."""
    total = torch.full((1,), value, dtype=torch.float64, device=_object_device(ctx, None))
    if not ctx.distributed:
        return lambda: total
    work = dist.all_reduce(total, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return total

    return wait


def all_mean(ctx: RunContext, values: torch.Tensor) -> torch.Tensor:
    """The element-wise mean of ``values`` over all ranks (``values`` itself if not distributed)."""
    if not ctx.distributed:
        return values
    total = values.detach().to(ctx.device, torch.float64).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / ctx.world_size


def all_max(ctx: RunContext, value: int) -> int:
    """The largest of every rank's ``value`` (``value`` itself if not distributed)."""
    return all_range(ctx, value)[1]


def all_range(ctx: RunContext, value: int) -> tuple[int, int]:
    """The smallest and the largest of every rank's ``value``, in one all-reduce (``value``
    twice if not distributed)."""
    if not ctx.distributed:
        return value, value
    device = _object_device(ctx, None) or torch.device("cpu")
    both = torch.tensor([-value, value], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    least, most = both.tolist()
    return -least, most


def _object_device(ctx: RunContext, group: dist.ProcessGroup | None) -> torch.device | None:
    """The device collectives over ``group`` move tensors through: the rank's own under NCCL
    (the default group's backend), the CPU (``None``) under gloo or for another group."""
    return ctx.device if ctx.backend == "nccl" and group is None else None
