"""Desync detection: every rank must run the same config on the same parameters.

DDP keeps replicas equal only if they start equal and apply equal updates. A rank whose config
differs (another file, another override), that resumed from another checkpoint (a node whose
disk held an older one) or whose parameters drifted (a nondeterministic kernel, a bit flip, a
plugin that touched one rank's weights) trains silently wrong. :func:`check_in_sync` compares a
digest of the resolved config, the step and a checksum of the parameters' bits over all ranks in
one all-gather of three int64s, and names the ranks that differ from rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ._context import RunContext

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = (1 << 63) - 1


class DesyncError(RuntimeError):
    """Ranks differ in config, step or parameters; the message names them."""


def parameter_checksum(model: nn.Module) -> int:
    """A checksum of the bits of every parameter of ``model``, in order: equal parameters give
    equal checksums on any device; one flipped bit changes it. (Buffers are left out: DDP
    syncs them from rank 0 at the next forward, so they may differ between steps.)"""
    sums = [
        tensor.detach().reshape(-1).view(_INT_OF_SIZE[tensor.element_size()]).sum(dtype=torch.int64)
        for tensor in model.parameters()
        if tensor.numel()
    ]
    total = 0
    for index, value in enumerate(torch.stack(sums).tolist() if sums else []):
        total = (total * 1_000_003 + value + index) & _MASK
    return total


def check_in_sync(
    ctx: RunContext, config_digest: str, step: int, model: nn.Module | None
) -> None:
    """Raise :class:`DesyncError` on every rank if any rank's config digest, step or parameter
    checksum differs from rank 0's, naming those ranks and what differs. A collective.
    ``model``: ``None`` where the ranks hold different shards of it (nothing to compare)."""
    if not ctx.distributed:
        return
    checksum = parameter_checksum(model) if model is not None else 0
    mine = torch.tensor([int(config_digest[:15], 16), step, checksum], dtype=torch.int64)
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    gathered = [torch.empty_like(mine, device=device) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine.to(device))
    rows = [row.tolist() for row in gathered]
    problems = []
    for rank, row in enumerate(rows[1:], start=1):
        what = [
            name
            for name, a, b in zip(("config", "step", "parameters"), rows[0], row, strict=True)
            if a != b
        ]
        if what:
            problems.append(f"rank {rank} in its {' and '.join(what)}")
    if problems:
        raise DesyncError(
            f"step {step}: ranks out of sync with rank 0: {'; '.join(problems)} (restart them "
            "from one checkpoint, with one config)"
        )
