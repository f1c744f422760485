"""Every random number generator a rank draws from, saved and restored as plain tensors.

A checkpoint keeps each rank's generators so that a resumed run draws what an unstopped one
would have: torch's CPU generator, the CUDA generator of the rank's device, numpy's global
generator and Python's :mod:`random`. The state is tensors, numbers and tuples only, so it
loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed torch's generators (CPU and every CUDA device), numpy's and Python's with ``seed``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The state of every generator this process draws from (CUDA's on ``device`` only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": _plain(random.getstate()),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Set the generators from :func:`rng_state`'s ``state``; a generator it lacks is left as
    it is (CUDA's, in a state saved on CPU)."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        saved = state["numpy"]
        keys = saved["keys"].numpy().view(np.uint32)
        np.random.set_state(
            (saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        )
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _plain(value: Any) -> Any:
    """``random.getstate()`` as lists (what ``weights_only`` loading rebuilds exactly)."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value
