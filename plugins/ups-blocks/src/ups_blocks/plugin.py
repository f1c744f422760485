"""The ``blocks`` sampler's plugin: its options and its record. No torch here: every ``ups``
command imports this module, and only a run builds the sampler (``ups_blocks.sampler``)."""

from __future__ import annotations

import attrs

from ups.core import SamplerPlugin, hookimpl, imported


@attrs.frozen(kw_only=True)
class BlockOptions:
    """Options of the ``blocks`` sampler (``sampler.options`` in the config)."""

    shuffle: bool = True
    """Visit this rank's block in a new random order every epoch."""
    repeats: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """Pass over the block this many times per epoch."""


@hookimpl
def ups_samplers() -> list[SamplerPlugin]:
    return [
        SamplerPlugin(
            name="blocks",
            factory=imported("ups_blocks.sampler:block_sampler"),
            options=BlockOptions,
            description="one contiguous block of the dataset per rank",
        )
    ]
