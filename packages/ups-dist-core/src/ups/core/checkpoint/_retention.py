"""Retention: which committed checkpoints a save deletes once it has committed."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

import structlog

from ._errors import describe

log = structlog.get_logger()

L = TypeVar("L")
"""How a storage names a checkpoint: its key (``step-100``)."""


def expired(
    steps: Sequence[int],
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protected: int | None = None,
    kept: Collection[int] = (),
) -> list[int]:
    """The committed steps to delete, oldest first.

    Kept: the newest ``keep_last`` (``None``: all), every step that is a multiple of
    ``keep_every`` (``None``: none kept for that), ``protected`` (the one ``latest``
    names), and the steps ``kept`` apart (keep-best's), which ``keep_last`` does not count.
    A save in flight is not committed, so it is never among ``steps``.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    if keep_last is None:
        return []
    ordered = sorted(set(steps) - set(kept))
    return [
        step
        for step in ordered[:-keep_last]
        if step != protected and not (keep_every and step % keep_every == 0)
    ]


def prune(
    committed: Mapping[int, L],
    remove: Callable[[L], None],
    *,
    keep_last: int | None,
    keep_every: int | None,
    protected: int,
    kept: Collection[int] = (),
    named: Callable[[L], str] = str,
) -> None:
    """Delete, with ``remove``, each committed checkpoint (``{step: where it is kept}``) that
    :func:`expired` lets go (``kept``: its steps kept apart). A deletion that fails is logged, the checkpoint ``named`` by its
    path or URL; the next save tries again."""
    for step in expired(
        list(committed),
        keep_last=keep_last,
        keep_every=keep_every,
        protected=protected,
        kept=kept,
    ):
        try:
            remove(committed[step])
        except Exception as error:  # the next save tries again
            log.warning(
                "could not delete an old checkpoint",
                checkpoint=named(committed[step]),
                error=describe(error),
            )
        else:
            log.debug("old checkpoint deleted", checkpoint=named(committed[step]))
