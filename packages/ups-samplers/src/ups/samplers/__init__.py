"""ups-samplers: distributed samplers for ups, selected by ``sampler: {name: ...}``.

- ``tensor``: :class:`TensorDistributedSampler`, ``torch.utils.data.DistributedSampler``'s
  indices, kept in tensors instead of Python lists.
"""

from ._tensor import TensorDistributedSampler, TensorSamplerOptions, tensor_sampler

__all__ = ["TensorDistributedSampler", "TensorSamplerOptions", "tensor_sampler"]
