"""Loading saved weights into a model that may no longer match them: one line saying which
parameters differ, where the weights came from, and what to do, instead of torch's error of
one line per parameter (resume; a warm start reuses it)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..config._errors import ConfigError

SHOWN = 3
"""How many differences a message names."""


def load_model_state(
    model: nn.Module, state: Mapping[str, object], *, key: str, source: str, advice: str
) -> None:
    """Load ``state`` into ``model`` (strictly), or raise one :class:`ConfigError` at ``key``
    naming the first differences (a parameter or buffer missing, unexpected, or of another
    shape), ``source`` (where the state came from) and ``advice`` (what to do)."""
    problems = differences(model.state_dict(), state)
    if problems:
        shown = "; ".join(problems[:SHOWN])
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise ConfigError(key, f"the model does not match {source}: {shown}{more}; {advice}")
    model.load_state_dict(state)


def differences(here: Mapping[str, object], there: Mapping[str, object]) -> list[str]:
    """How ``there`` (saved) differs from ``here`` (the model's own state), by name, in the
    model's order: each name missing from either side, and each tensor of another shape."""
    found = []
    for name, tensor in here.items():
        saved = there.get(name)
        if name not in there:
            found.append(f"{name}: not saved")
        elif (
            isinstance(tensor, torch.Tensor)
            and isinstance(saved, torch.Tensor)
            and tensor.shape != saved.shape
        ):
            found.append(f"{name}: {_shape(saved)} saved, {_shape(tensor)} in the model")
    found += [f"{name}: saved, not in the model" for name in there if name not in here]
    return found


def _shape(tensor: torch.Tensor) -> str:
    return f"[{', '.join(map(str, tensor.shape))}]"
