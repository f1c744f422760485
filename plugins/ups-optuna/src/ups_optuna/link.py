"""How a trial's ranks reach its Optuna trial: one environment variable, set by ``ups sweep``
for the trial's processes, which torchrun and the local launcher pass on to every rank.

Rank 0 alone reports the objective's intermediate values to the study's storage and asks the
pruner; :func:`ups.core.decide` hands its answer to every rank, and every rank stops at the same
step (see :mod:`ups_optuna.plugin`).
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING

import attrs

from ups.core import structure

from .space import Objective, Pruning

if TYPE_CHECKING:
    import optuna

ENV = "UPS_OPTUNA_TRIAL"
PRUNED_AT = "pruned_at_step"
"""The trial's user attribute rank 0 sets when the pruner stops it: the step."""


class TrialPrunedError(Exception):
    """Raised on every rank of a trial the pruner stopped, at the same step."""


@attrs.frozen(kw_only=True)
class TrialLink:
    """Where a running trial reports: the study's storage, the trial, what and how to prune."""

    storage: str
    study: str
    trial: int
    """The trial's number in the study."""
    objective: Objective
    pruner: Pruning

    def env(self) -> dict[str, str]:
        """The environment variable that carries this link to the trial's ranks."""
        return {ENV: json.dumps(attrs.asdict(self))}


def current() -> TrialLink | None:
    """The link of the trial this process trains for, or ``None`` outside a sweep."""
    text = os.environ.get(ENV)
    return structure(TrialLink, json.loads(text), ENV) if text else None


@functools.cache
def _study(link: TrialLink) -> tuple[optuna.Study, optuna.storages.BaseStorage, int]:
    """The trial's study, with its pruner, its storage and the trial's id (once a process)."""
    import optuna

    storage = optuna.storages.get_storage(link.storage)
    study = optuna.load_study(study_name=link.study, storage=storage, pruner=link.pruner.pruner())
    study_id = storage.get_study_id_from_name(link.study)
    return study, storage, storage.get_trial_id_from_study_id_trial_number(study_id, link.trial)


def report(link: TrialLink, step: int, value: float) -> bool:
    """Report the objective's ``value`` at ``step`` and return whether to prune (on rank 0)."""
    study, storage, trial_id = _study(link)
    storage.set_trial_intermediate_value(trial_id, step, value)
    prune = study.pruner.prune(study, storage.get_trial(trial_id))
    if prune:
        storage.set_trial_user_attr(trial_id, PRUNED_AT, step)
    return prune
