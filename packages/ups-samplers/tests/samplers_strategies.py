"""Hypothesis strategies for ups-samplers' property tests."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st


@attrs.frozen
class Case:
    """Arguments of one distributed sampler, for every rank of its world."""

    size: int
    world_size: int
    seed: int
    epoch: int
    shuffle: bool
    drop_last: bool


@st.composite
def cases(draw: st.DrawFn, max_size: int = 2000, max_world_size: int = 9) -> Case:
    """A dataset size (empty and smaller than the world included), a world size, a seed, an
    epoch, and the two options."""
    return Case(
        size=draw(st.integers(0, max_size)),
        world_size=draw(st.integers(1, max_world_size)),
        seed=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 1000)),
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
    )


chunk_sizes = st.integers(1, 64)
"""Chunk sizes small enough that most index lists span several chunks."""
