"""Checkpoint errors, and how every rank learns that one rank failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from .collectives import RankFailedError, decide, gather_failures
from .context import RunContext

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed; raised on every rank, naming the failing ranks."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds objects that loading would have to run code to rebuild."""


_ERRORS: dict[str, type[CheckpointError]] = {
    "UnsafeCheckpointError": UnsafeCheckpointError,
}


def agree(
    ctx: RunContext, what: str, error: Exception | None, group: dist.ProcessGroup | None = None
) -> None:
    """Tell every rank which ranks failed ``what``; if any did, raise on every rank.

    The error names the failing ranks and their messages. It is an
    :class:`UnsafeCheckpointError` when every failing rank failed with one, else a
    :class:`CheckpointError`. A collective over ``group`` (``None``: the default group): every
    rank calls it, failed or not.
    """
    failed = gather_failures(ctx, error, group=group)
    if not failed:
        return
    kinds = {f.kind for f in failed}
    cls = _ERRORS.get(kinds.pop(), CheckpointError) if len(kinds) == 1 else CheckpointError
    ranks = ", ".join(str(f.rank) for f in failed)
    details = "; ".join(f"rank {f.rank}: {f.kind}: {f.message}" for f in failed)
    raise cls(f"{what} failed on rank{'s' if len(failed) > 1 else ''} {ranks}: {details}") from (
        error
    )


def on_main(
    ctx: RunContext, what: str, action: Callable[[], T], group: dist.ProcessGroup | None = None
) -> T:
    """Run ``action`` on rank 0 and hand its result to every rank; if it fails, raise a
    :class:`CheckpointError` saying ``what`` failed and why, on every rank. A collective."""
    try:
        return decide(ctx, action, group=group)
    except RankFailedError as error:
        raise CheckpointError(f"{what} failed: {error}") from error
    except CheckpointError:
        raise
    except Exception as error:  # not distributed: decide ran it here
        raise CheckpointError(f"{what} failed: {describe(error)}") from error


def describe(error: BaseException) -> str:
    """``Kind: message``, as errors are reported across ranks."""
    return f"{type(error).__name__}: {error}"
