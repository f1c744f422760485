"""ups-fsdp: sharded data parallel strategies for ups, selected by ``strategy: {name: ...}``.

``zero`` keeps DDP and shards the optimizer's state (``ZeroRedundancyOptimizer``, ZeRO-1);
``fsdp`` shards parameters, gradients and optimizer state with FSDP2 (``fully_shard`` over a
``DeviceMesh``; ZeRO-3, ZeRO-2, or hybrid HSDP). Both keep every guarantee of the engine:
exact sample weighting, accumulation, global-norm clipping, checkpoints of the full state that
resume on any number of ranks (see docs/strategies.md).
"""
