"""The ``bf16`` and ``fp16`` hooks: all-reduce each gradient bucket in 16 bits.

Modelled on torch's ``ddp_comm_hooks.default_hooks._compress_hook``, with two differences:

- It runs on every backend. torch's ``bf16_compress_hook`` is refused by
  ``DistributedDataParallel.register_comm_hook`` (by its name) unless torch was built with
  CUDA and NCCL >= 2.10, so it cannot be used on CPU with gloo. gloo's ``all_reduce`` sums
  bfloat16 and float16 tensors itself (checked on torch 2.13), so 16-bit values are what
  travels: half the bytes of float32 gradients.
- It averages before compressing, in the bucket's own precision: one rounding to 16 bits
  instead of torch's two (cast, then divide in 16 bits). Dividing before the sum also keeps
  float16's sum from overflowing where the average would not.

Gradients come back as the average over the ranks of each rank's gradient, rounded to 16 bits
(and the 16-bit sum rounded again). float16 overflows to ``inf`` beyond 65504 and loses
precision below about 6e-5; bfloat16 has float32's range but only 8 significant bits.
"""

# No `from __future__ import annotations` here: register_comm_hook checks the hook's
# annotations against the objects dist.GradBucket and torch.futures.Future[torch.Tensor].

from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ups.core import NoOptions, RunContext

if TYPE_CHECKING:
    # torch.distributed re-exports it only when distributed is available: invisible to mypy.
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket


@attrs.frozen(eq=False)
class CompressionState:
    """The state :func:`compress_hook` is registered with."""

    process_group: dist.ProcessGroup
    """The group the gradients are averaged over: the DDP model's own."""
    dtype: torch.dtype
    """The dtype gradients travel in: ``torch.bfloat16`` or ``torch.float16``."""


def compress_hook(
    state: CompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over ``state.process_group``, sent as ``state.dtype``.

    Divides the bucket by the group's size in place, casts it to ``state.dtype``, all-reduces
    it (sum) and copies the result back into the bucket, in its own dtype.
    """
    buffer = bucket.buffer()
    buffer.div_(state.process_group.size())
    compressed = buffer.to(state.dtype)  # `buffer` itself when it is already in that dtype
    work = dist.all_reduce(compressed, group=state.process_group, async_op=True)

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        # Into the bucket's own buffer, to keep peak memory down (pytorch/pytorch#45968).
        return buffer.copy_(fut.value()[0])

    return work.get_future().then(decompress)  # type: ignore[no-any-return]


@attrs.frozen
class CompressionHook:
    """The factory of the ``bf16`` and ``fp16`` plugins: registers :func:`compress_hook`."""

    dtype: torch.dtype
    """The dtype gradients travel in."""

    def __call__(
        self, ddp: DistributedDataParallel, *, ctx: RunContext, options: NoOptions
    ) -> CompressionState:
        """Register :func:`compress_hook` on ``ddp``; return its state.

        :param ctx: unused: the hook averages over ``ddp``'s process group.
        """
        state = CompressionState(process_group=ddp.process_group, dtype=self.dtype)
        ddp.register_comm_hook(state, compress_hook)
        return state


bf16_compression = CompressionHook(torch.bfloat16)
"""The ``bf16`` plugin's factory."""

fp16_compression = CompressionHook(torch.float16)
"""The ``fp16`` plugin's factory."""
