"""ups-samplers: distributed samplers for ups, selected by ``sampler: {name: ...}``.

- ``tensor``: :class:`TensorDistributedSampler`, ``torch.utils.data.DistributedSampler``'s
  indices, kept in tensors instead of Python lists.
- ``multitask``: :class:`MultiTaskDistributedSampler`, tasks mixed as configured, every rank
  with its share of every task, tasks interleaved.
- ``exact`` (for ``eval.sampler``): :class:`ExactDistributedSampler`, every sample on exactly
  one rank, none padded.

All three resume mid-epoch from ``state_dict()``, on as many ranks or on another number.
"""

from typing import TYPE_CHECKING

from ups.core import lazy_exports

if TYPE_CHECKING:
    from ._exact import ExactDistributedSampler, ExactSamplerOptions, exact_sampler
    from ._multitask import (
        MultiTaskDistributedSampler,
        MultiTaskSamplerOptions,
        epoch_length,
        mixture,
        multitask_sampler,
    )
    from ._task_ids import WithTaskIds
    from ._tensor import TensorDistributedSampler, TensorSamplerOptions, tensor_sampler

_EXPORTS = {
    "ExactDistributedSampler": "._exact",
    "ExactSamplerOptions": "._exact",
    "exact_sampler": "._exact",
    "MultiTaskDistributedSampler": "._multitask",
    "MultiTaskSamplerOptions": "._multitask",
    "epoch_length": "._multitask",
    "mixture": "._multitask",
    "multitask_sampler": "._multitask",
    "WithTaskIds": "._task_ids",
    "TensorDistributedSampler": "._tensor",
    "TensorSamplerOptions": "._tensor",
    "tensor_sampler": "._tensor",
}

__all__ = [
    "ExactDistributedSampler",
    "ExactSamplerOptions",
    "MultiTaskDistributedSampler",
    "MultiTaskSamplerOptions",
    "TensorDistributedSampler",
    "TensorSamplerOptions",
    "WithTaskIds",
    "epoch_length",
    "exact_sampler",
    "mixture",
    "multitask_sampler",
    "tensor_sampler",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
