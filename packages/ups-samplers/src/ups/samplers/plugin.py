"""The ``ups-samplers`` plugin: registers the samplers of this distribution with ups."""

from __future__ import annotations

from ups.core import SamplerPlugin, hookimpl

from ._tensor import TensorSamplerOptions, tensor_sampler


@hookimpl
def ups_samplers() -> list[SamplerPlugin]:
    return [
        SamplerPlugin(
            name="tensor",
            factory=tensor_sampler,
            options=TensorSamplerOptions,
            description="DistributedSampler's indices, kept in int32 tensors, yielded in chunks",
        )
    ]
