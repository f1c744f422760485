"""The training run, for the Python API and for steps of one's own: ``train_rank`` runs a
config's training on this rank (the ranks' side of ``ups.core.train``), over the parts the
config builds; ``load_model`` builds a run's model with its trained weights, from its folder;
``Step`` is the contract a model's step follows; batches of any structure move with
``to_device``; a ``Strategy`` spreads the model over the ranks; an ``EMA`` of the weights is kept in a run or a loop of one's own; a
``Schedule`` of rules (``Rule``) changes training at a step every rank agrees on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._batches import BatchError, batch_size, tensors, to_device
    from ._ema import EMA
    from ._guard import Guard, GuardStoppedError
    from ._model import load_model
    from ._optim import step_on_plateau
    from ._run import train, train_rank
    from ._schedule import Action, Plateau, Rule, Schedule, Trigger
    from ._step import Step, StepError
    from ._strategy import Strategy

_EXPORTS = {
    "EMA": "._ema",
    "Guard": "._guard",
    "GuardStoppedError": "._guard",
    "load_model": "._model",
    "train": "._run",
    "train_rank": "._run",
    "Step": "._step",
    "StepError": "._step",
    "Strategy": "._strategy",
    "BatchError": "._batches",
    "batch_size": "._batches",
    "tensors": "._batches",
    "to_device": "._batches",
    "Action": "._schedule",
    "Plateau": "._schedule",
    "step_on_plateau": "._optim",
    "Rule": "._schedule",
    "Schedule": "._schedule",
    "Trigger": "._schedule",
}
"""Each public name and the module that defines it."""

__all__ = [
    "Action",
    "batch_size",
    "EMA",
    "Guard",
    "GuardStoppedError",
    "BatchError",
    "load_model",
    "Plateau",
    "Rule",
    "Schedule",
    "Step",
    "StepError",
    "step_on_plateau",
    "Strategy",
    "tensors",
    "to_device",
    "train",
    "train_rank",
    "Trigger",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
