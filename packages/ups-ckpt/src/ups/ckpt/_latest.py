"""Which committed checkpoint to load: the rule the ``local``, ``sharded`` and ``fsspec``
backends share, whatever they keep checkpoints in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import structlog

from .errors import CheckpointError
from .manifest import Manifest

log = structlog.get_logger()


class Entry(Protocol):
    """A committed checkpoint as a backend lists it."""

    @property
    def manifest(self) -> Manifest: ...


E = TypeVar("E", bound=Entry)


def newest_verified(
    committed: Sequence[E],
    *,
    latest: str | None,
    location: Callable[[E], str],
    damage: Callable[[E], str | None],
    where: str,
) -> E | None:
    """The checkpoint ``latest`` names, else the newest of ``committed`` (oldest first), if it
    verifies; else the newest that does, with a warning naming each damaged one skipped.

    :param latest: where the ``latest`` pointer points (a location), or ``None``.
    :param location: a checkpoint's location (a path or URL), as messages name it.
    :param damage: what is wrong with a checkpoint's files, ``None`` when they match.
    :param where: the backend's place in messages: ``in <folder>``, ``under <url>``.
    :raises CheckpointError: when checkpoints are committed but none verifies.
    """
    named = [c for c in committed if location(c) == latest]
    if latest is not None and not named and committed:
        log.warning("'latest' names no committed checkpoint", latest=latest)
    for candidate in named + [c for c in reversed(committed) if c not in named]:
        problem = damage(candidate)
        if problem is None:
            return candidate
        log.warning(
            "damaged checkpoint skipped: loading an older one",
            checkpoint=location(candidate),
            damage=problem,
        )
    if committed:
        raise CheckpointError(
            f"no checkpoint {where} verifies against its COMMIT manifest "
            f"({len(committed)} damaged); move them away to start afresh"
        )
    return None
