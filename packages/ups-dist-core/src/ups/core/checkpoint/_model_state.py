"""Loading saved weights into a model that may no longer match them: one line saying which
parameters differ, where the weights came from, and what to do, instead of torch's error of
one line per parameter (resume, and a warm start: ``model.init_from``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..config._errors import ConfigError

SHOWN = 3
"""How many differences a message names."""


def load_model_state(
    model: nn.Module,
    state: Mapping[str, object],
    *,
    key: str,
    source: str,
    advice: str,
    strict: bool = True,
    place: Place | None = None,
) -> Missing:
    """Load ``state`` into ``model``, or raise one :class:`ConfigError` at ``key`` naming the
    first differences (a parameter or buffer missing, unexpected, or of another shape),
    ``source`` (where the state came from) and ``advice`` (what to do). Not ``strict``: only
    shapes that differ are refused, what fits is loaded; return the names left out.
    ``place``: what puts the (full) saved tensors where the model's are, given the model's
    state (:meth:`ups.core.Strategy.scattered`: a sharded model's shards)."""
    here = model.state_dict()
    problems = differences(here, state, names=strict)
    if problems:
        shown = "; ".join(problems[:SHOWN])
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise ConfigError(key, f"the model does not match {source}: {shown}{more}; {advice}")
    left_out = model.load_state_dict(place(state, here) if place else state, strict=strict)
    return Missing(tuple(left_out.missing_keys), tuple(left_out.unexpected_keys))


Place = Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, Any]]
"""Places saved tensors like the model's own: ``place(saved, model_state)``."""


class Missing(NamedTuple):
    """The names a loose load left out: the model's not in the state, the state's not in the
    model."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def differences(
    here: Mapping[str, object], there: Mapping[str, object], *, names: bool = True
) -> list[str]:
    """How ``there`` (saved) differs from ``here`` (the model's own state), by name, in the
    model's order: each tensor of another shape and, with ``names``, each name missing from
    either side."""
    found = []
    for name, tensor in here.items():
        saved = there.get(name)
        if name not in there:
            found += [f"{name}: not saved"] if names else []
        elif (
            isinstance(tensor, torch.Tensor)
            and isinstance(saved, torch.Tensor)
            and tensor.shape != saved.shape
        ):
            found.append(f"{name}: {_shape(saved)} saved, {_shape(tensor)} in the model")
    if names:
        found += [f"{name}: saved, not in the model" for name in there if name not in here]
    return found


def _shape(tensor: torch.Tensor) -> str:
    return f"[{', '.join(map(str, tensor.shape))}]"
