"""Checkpoint errors, and how every rank learns that one rank failed."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from ..config._errors import UsageError
from ..dist._collectives import Failure, Raising, RankFailedError, decide
from ..dist._context import RunContext

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed; raised on every rank, naming the failing ranks."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds objects that loading would have to run code to rebuild."""


class DiskFullError(CheckpointError):
    """A checkpoint could not be written: its filesystem has no space left (or the user's
    quota is spent)."""


_ERRORS: dict[str, type[CheckpointError]] = {
    "DiskFullError": DiskFullError,
    "UnsafeCheckpointError": UnsafeCheckpointError,
}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def failing(what: str) -> Raising:
    """How an :class:`~ups.core.dist._collectives.Agreement` about a checkpoint fails: on every
    rank, with an error saying that ``what`` failed and naming the failing ranks and their
    messages. It is an :class:`UnsafeCheckpointError` (a :class:`DiskFullError`) when every
    failing rank failed with one, else a :class:`CheckpointError`."""

    def raising(failed: list[Failure], error: Exception | None) -> CheckpointError:
        kinds = {f.kind for f in failed}
        cls = _ERRORS.get(kinds.pop(), CheckpointError) if len(kinds) == 1 else CheckpointError
        alike: dict[str, list[int]] = {}
        for f in failed:
            alike.setdefault(f"{f.kind}: {f.message}", []).append(f.rank)
        details = "; ".join(f"{_ranks(ranks)}: {said}" for said, ranks in alike.items())
        if len(alike) == 1:
            details = f"{_ranks([f.rank for f in failed])}: {next(iter(alike))}"
        return cls(f"{what} failed on {details}")

    return raising


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 1``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def on_main(
    ctx: RunContext, what: str, action: Callable[[], T], group: dist.ProcessGroup | None = None
) -> T:
    """Run ``action`` on rank 0 and hand its result to every rank; if it fails, raise a
    :class:`CheckpointError` saying ``what`` failed and why, on every rank. A collective."""
    try:
        return decide(ctx, action, group=group)
    except RankFailedError as error:  # another rank's: said as that rank says it, below
        failure = error.failure
        if failure is None or failure.usage:
            raise
        said = f"{failure.kind}: {failure.message}"
        raise CheckpointError(f"{what} failed on rank {failure.rank}: {said}") from error
    except (CheckpointError, UsageError):
        raise
    except Exception as error:  # this rank's
        where = f" on rank {ctx.rank}" if ctx.distributed else ""
        raise CheckpointError(f"{what} failed{where}: {describe(error)}") from error


def describe(error: BaseException) -> str:
    """``Kind: message``, as errors are reported across ranks."""
    return f"{type(error).__name__}: {error}"


def disk_full(error: Exception, where: str, needed: int) -> Exception:
    """``error`` as a :class:`DiskFullError` when the system said that no space was left
    while it was raised (torch's writer turns that into ``enforce fail ... unexpected pos``,
    keeping the system's error as its context), saying so, ``where`` (``"in <folder>"``)
    and the ``needed`` bytes this rank was writing; any other ``error`` as it is."""
    cause: BaseException | None = error
    seen: set[int] = set()  # a chain may loop back on itself
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in _NO_SPACE:
            full = DiskFullError(
                f"the disk is full: {cause.strerror} {where}, where this rank's part of the "
                f"checkpoint needs about {_bytes(needed)}"
            )
            full.__cause__ = error
            return full
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return error


def _bytes(size: int) -> str:
    """``size`` bytes in decimal units: ``512 B``, ``1.3 MB``."""
    if size < 1000:
        return f"{size} B"
    value = float(size)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            break
    return f"{value:.1f} {unit}"
