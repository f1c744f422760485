"""ups-fsdp: sharded data parallel strategies for ups, selected by ``strategy: {name: ...}``.

``zero`` keeps DDP and shards the optimizer's state (``ZeroRedundancyOptimizer``, ZeRO-1);
``fsdp`` shards parameters, gradients and optimizer state with FSDP2 (``fully_shard`` over a
``DeviceMesh``; ZeRO-3, ZeRO-2, or hybrid HSDP). Both keep every guarantee of the engine:
exact sample weighting, accumulation, global-norm clipping, checkpoints of the full state that
resume on any number of ranks (see docs/strategies.md).

In a loop of one's own, :func:`strategy` builds one by name (see docs/own-loop.md).
"""

from typing import TYPE_CHECKING

from ups.core import lazy_exports

if TYPE_CHECKING:
    from ._by_name import strategy
    from ._options import FSDPOptions

_EXPORTS = {"strategy": "._by_name", "FSDPOptions": "._options"}
"""Each public name and the module that defines it."""

__all__ = ["FSDPOptions", "strategy"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
