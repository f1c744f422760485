"""The ``fsdp`` strategy's options (``strategy.options``): plain attrs, no torch, so that
``ups validate`` and ``ups plugins`` import none."""

from __future__ import annotations

from typing import Literal

import attrs

from ups.core import at_least


@attrs.frozen(kw_only=True)
class FSDPOptions:
    """Options of the ``fsdp`` strategy."""

    blocks: tuple[str, ...] = ()
    """The modules sharded as one unit each (``fully_shard`` per block, then the root): by class
    name (``TransformerBlock``), or ``module:function`` / ``path.py:function`` naming a callable
    that takes the model and returns its blocks (a relative path from the working directory).
    ``[]``: the children of every ``nn.Sequential``, ``nn.ModuleList`` and ``nn.ModuleDict``
    that hold parameters. Blocks nested in blocks are sharded innermost first; with
    ``training.compile``, each block is compiled in place before it is sharded (the model
    itself where there is none)."""
    reshard_after_forward: bool = True
    """``true``: parameters sharded again after each forward (ZeRO-3, least memory);
    ``false``: kept gathered until the backward (ZeRO-2, fewer all-gathers)."""
    reduce_dtype: Literal["fp32", "bf16"] | None = None
    """The dtype gradients are reduce-scattered in; ``null``: the parameters' compute dtype
    (``bf16`` under ``training.precision: bf16``, else fp32)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in CPU memory (CUDA only: a
    run on the CPU refuses it)."""
    replicate: int = attrs.field(default=1, validator=at_least(1))
    """Hybrid sharding (HSDP): the ranks form ``replicate`` groups, each sharding the model
    over its ``world_size / replicate`` ranks, the groups all-reducing between them (one
    group per node, say); ``1``: shard over every rank. It must divide the number of ranks."""
