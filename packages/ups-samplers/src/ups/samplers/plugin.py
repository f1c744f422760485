"""The ``ups-samplers`` plugin: registers the samplers of this distribution with ups.

The samplers' modules (and torch) are imported when a sampler is selected, not when listed.
"""

from __future__ import annotations

from ups.core import SamplerPlugin, hookimpl, imported


@hookimpl
def ups_samplers() -> list[SamplerPlugin]:
    return [
        SamplerPlugin(
            name="tensor",
            factory=imported("ups.samplers._tensor:tensor_sampler"),
            options=imported("ups.samplers._tensor:TensorSamplerOptions"),
            even=True,
            world_invariant=True,
            description="DistributedSampler's indices, kept in int32 tensors, resumable",
        ),
        SamplerPlugin(
            name="multitask",
            factory=imported("ups.samplers._multitask:multitask_sampler"),
            options=imported("ups.samplers._multitask:MultiTaskSamplerOptions"),
            multi_task=True,
            even=True,
            world_invariant=True,
            description="tasks mixed balanced/proportional/temperature/weights, even per rank",
        ),
        SamplerPlugin(
            name="exact",
            factory=imported("ups.samplers._exact:exact_sampler"),
            options=imported("ups.samplers._exact:ExactSamplerOptions"),
            exact=True,
            description="for evaluation: every sample on exactly one rank, optionally shuffled",
        ),
    ]
