"""The ``ups-samplers`` plugin: registers the samplers of this distribution with ups.

The samplers' modules (and torch) are imported when the hook is called, not with this module.
"""

from __future__ import annotations

from ups.core import SamplerPlugin, hookimpl


@hookimpl
def ups_samplers() -> list[SamplerPlugin]:
    from ._exact import ExactSamplerOptions, exact_sampler
    from ._multitask import MultiTaskSamplerOptions, multitask_sampler
    from ._tensor import TensorSamplerOptions, tensor_sampler

    return [
        SamplerPlugin(
            name="tensor",
            factory=tensor_sampler,
            options=TensorSamplerOptions,
            description="DistributedSampler's indices, kept in int32 tensors, resumable",
        ),
        SamplerPlugin(
            name="multitask",
            factory=multitask_sampler,
            options=MultiTaskSamplerOptions,
            multi_task=True,
            description="tasks mixed balanced/proportional/temperature/weights, even per rank",
        ),
        SamplerPlugin(
            name="exact",
            factory=exact_sampler,
            options=ExactSamplerOptions,
            exact=True,
            description="for evaluation: every sample on exactly one rank, optionally shuffled",
        ),
    ]
