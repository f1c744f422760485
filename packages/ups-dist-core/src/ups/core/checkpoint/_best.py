"""Keep-best: the checkpoints kept for an evaluated metric, apart from retention's newest.

A run with ``checkpoint.options.keep_best`` saves a checkpoint at each evaluation whose
monitored value enters the best ``count`` seen so far (:func:`admit`); the commit protocol
records that value in the checkpoint's ``COMMIT`` manifest, never deletes the checkpoints
:func:`ranked` keeps, and points ``best`` at the first of them. Which checkpoints are the best is
thus read from the checkpoints themselves, on every backend, and survives a resume.

In a run of stages (``stages``) each save of a stage with keep-best records its stage
(:data:`STAGE`): a stage ranks its own checkpoints only, ``best`` names the best of the stage
saving (:func:`stage_best`), and an earlier stage's checkpoints saved for an evaluation are
never deleted (:func:`kept_apart`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ..config._structure import at_least, structure

KEY = "checkpoint.options.keep_best"
"""Where keep-best is configured."""
BEST_POINTER = "best"
"""The pointer beside ``latest`` that names the best checkpoint kept (the file ``best``
holding ``step-40``)."""


STAGE = "stage"
"""The entry of a save's ``metrics`` (and so of its manifest's) naming the index of the run's
stage that saved it; a checkpoint without it is stage 0's (a run without stages, or saved
before stages were recorded)."""


def stage_of(metrics: Mapping[str, float]) -> int:
    """The index of the stage that saved a checkpoint whose manifest records ``metrics``."""
    return int(metrics.get(STAGE, 0))


def stage_best(
    recorded: Mapping[int, Mapping[str, float]], stage: int, keep: KeepBest
) -> list[int]:
    """The steps of the best ``keep.count`` checkpoints of ``stage`` (``recorded``: ``{step:
    the metrics its manifest records}``) by ``keep``'s monitored value, best first."""
    scores = {
        step: metrics[keep.monitor]
        for step, metrics in recorded.items()
        if keep.monitor in metrics and stage_of(metrics) == stage
    }
    return ranked(scores, keep)


def kept_apart(recorded: Mapping[int, Mapping[str, float]], stage: int | None) -> list[int]:
    """The steps of the checkpoints of ``recorded`` (``{step: the metrics its manifest
    records}``) saved for an evaluation by a stage other than ``stage`` (the stage saving with
    keep-best; ``None``: a save without keep-best, any stage): an earlier stage's best, which
    retention keeps once a later stage saves."""
    return [
        step
        for step, metrics in sorted(recorded.items())
        if stage_of(metrics) != stage and set(metrics) - {STAGE}
    ]


def _named(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise ValueError("name an evaluated value, such as val_loss")


@attrs.frozen(kw_only=True)
class KeepBest:
    """``checkpoint.options.keep_best``: keep the best ``count`` checkpoints by ``monitor``."""

    monitor: str = attrs.field(validator=_named)
    """The evaluated value ranked, named as the ``eval`` log event names it: ``val_loss``,
    ``val_loss/<task>`` or ``val_<metric>`` (``val_nrmse``, ``val_nrmse/<task>``)."""
    mode: Literal["min", "max"] = "min"
    """``min``: lower is better (a loss); ``max``: higher is better (an accuracy)."""
    count: int = attrs.field(default=1, validator=at_least(1))
    """How many of the best checkpoints to keep."""


def ranked(scores: Mapping[int, float], keep: KeepBest) -> list[int]:
    """The steps of the best ``keep.count`` of ``scores`` (``{step: monitored value}``), best
    first. A NaN is never among them; of equal values the earlier step ranks first."""
    sign = 1.0 if keep.mode == "min" else -1.0
    finite = [step for step, value in scores.items() if not math.isnan(value)]
    return sorted(finite, key=lambda step: (sign * scores[step], step))[: keep.count]


def admit(
    scores: Mapping[int, float], step: int, value: float, keep: KeepBest
) -> dict[int, float] | None:
    """The best ``keep.count`` of ``scores`` once ``value``, evaluated at ``step`` (after
    every step of ``scores``), joins them, by step; ``None`` when it does not enter them (a
    NaN, or not strictly better than the worst of a full set)."""
    joined = {**scores, step: value}
    kept = ranked(joined, keep)
    return {s: joined[s] for s in kept} if step in kept else None


def keep_best(options: Mapping[str, Any]) -> KeepBest | None:
    """The ``keep_best`` of a checkpoint backend's ``options`` (``checkpoint.options``), or
    ``None``.

    :raises ConfigError: naming the key, for a bad one.
    """
    found = options.get("keep_best")
    return None if found is None else structure(KeepBest, found, KEY)
