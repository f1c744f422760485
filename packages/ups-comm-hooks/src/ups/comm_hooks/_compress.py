"""The ``allreduce``, ``bf16`` and ``fp16`` hooks: average each gradient bucket, sent as it is
or in 16 bits.

Modelled on torch's ``ddp_comm_hooks.default_hooks`` (``allreduce_hook``, ``_compress_hook``),
with these differences:

- It runs on every backend. torch's ``bf16_compress_hook`` is refused by
  ``DistributedDataParallel.register_comm_hook`` (by its name) unless torch was built with
  CUDA and NCCL >= 2.10, so it cannot be used on CPU with gloo. gloo's ``all_reduce`` sums
  bfloat16 and float16 tensors itself (checked on torch 2.13), so 16-bit values are what
  travels: half the bytes of float32 gradients.
- It averages before compressing, in the bucket's own precision: one rounding to 16 bits
  instead of torch's two (cast, then divide in 16 bits). Dividing before the sum also keeps
  float16's sum from overflowing where the average would not.
- It counts what it sends (see :mod:`._traffic`) and warns, once on rank 0, when compressing is
  pointless (gradients already in that dtype) or loses gradients (float16 flushing nonzero
  values to zero, as under fp16 autocast without a gradient scaler).

``allreduce`` does what DDP does without a hook (divide by the world size, then sum), so its
gradients are DDP's, bit for bit: the reference the others are measured against.

Gradients come back as the average over the ranks of each rank's gradient, rounded to 16 bits
(and the 16-bit sum rounded again). float16 overflows to ``inf`` beyond 65504 and loses
precision below about 6e-5; bfloat16 has float32's range but only 8 significant bits.
"""

# No `from __future__ import annotations` here: register_comm_hook checks the hook's
# annotations against the objects dist.GradBucket and torch.futures.Future[torch.Tensor].

from typing import TYPE_CHECKING

import attrs
import structlog
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ups.core import RunContext

from ._traffic import HookOptions, Traffic, register

if TYPE_CHECKING:
    # torch.distributed re-exports it only when distributed is available: invisible to mypy.
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

log = structlog.get_logger()


class CompressionState(Traffic):
    """The state :func:`compress_hook` is registered with."""

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        dtype: torch.dtype | None,
        *,
        profile: bool = False,
        warn: bool = False,
    ) -> None:
        super().__init__(process_group, profile=profile)
        self.dtype = dtype
        """The dtype gradients travel in, or ``None``: the gradients' own."""
        self._check_underflow = warn and dtype == torch.float16

    def underflow(self, averaged: torch.Tensor, compressed: torch.Tensor) -> None:
        """Warn (once) when casting ``averaged`` to ``compressed`` zeroed nonzero values."""
        if not self._check_underflow:
            return
        self._check_underflow = False
        lost = int(torch.count_nonzero((averaged != 0) & (compressed == 0)))
        if lost:
            log.warning(
                "comm_hook fp16: gradients below float16's range are sent as zeros; scale the"
                " loss (a GradScaler, as training.precision fp16 does) or use bf16",
                zeroed=lost,
                of=averaged.numel(),
            )


def compress_hook(
    state: CompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over ``state.process_group``, sent as ``state.dtype``.

    Divides the bucket by the group's size in place, casts it to ``state.dtype`` (when that is
    not its own), all-reduces it (sum) and copies the result back into the bucket.
    """
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    compressed = buffer if state.dtype is None else buffer.to(state.dtype)
    if compressed is buffer:  # sent as it is (or already in that dtype)
        return state.all_reduce(buffer, bucket.index())
    state.underflow(buffer, compressed)

    def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        # Into the bucket's own buffer, to keep peak memory down (pytorch/pytorch#45968).
        return buffer.copy_(fut.value())

    return state.all_reduce(compressed, bucket.index()).then(decompress)


@attrs.frozen
class CompressionHook:
    """The factory of the ``allreduce``, ``bf16`` and ``fp16`` plugins: registers
    :func:`compress_hook`."""

    dtype: torch.dtype | None
    """The dtype gradients travel in; ``None``: their own."""

    def __call__(
        self, ddp: DistributedDataParallel, *, ctx: RunContext, options: HookOptions
    ) -> CompressionState:
        """Register :func:`compress_hook` on ``ddp`` (timed when ``options.profile``); return
        its state. Warns on rank 0 when ``ddp``'s gradients are already in the dtype."""
        warn = ctx.rank == 0
        state = CompressionState(ddp.process_group, self.dtype, profile=options.profile, warn=warn)
        dtypes = {p.dtype for p in ddp.module.parameters() if p.requires_grad}
        if warn and self.dtype is not None and dtypes == {self.dtype}:
            log.warning(
                f"comm_hook: the gradients are {self.dtype} already, so compressing them to it"
                " sends as many bytes as allreduce does, at the cost of a copy; use allreduce",
            )
        return register(ddp, state, compress_hook)


allreduce = CompressionHook(None)
"""The ``allreduce`` plugin's factory: gradients averaged as they are, as DDP does."""

bf16_compression = CompressionHook(torch.bfloat16)
"""The ``bf16`` plugin's factory."""

fp16_compression = CompressionHook(torch.float16)
"""The ``fp16`` plugin's factory."""
