"""The ``ups-fsdp`` plugin: registers the ``zero`` and ``fsdp`` strategies.

The strategies' modules (and torch) are imported when one is selected, not when listed.
"""

from __future__ import annotations

from ups.core import StrategyPlugin, hookimpl, imported


@hookimpl
def ups_strategies() -> list[StrategyPlugin]:
    return [
        StrategyPlugin(
            name="zero",
            factory=imported("ups.fsdp._zero:zero"),
            description="DDP with the optimizer's state sharded over the ranks (ZeRO-1)",
        ),
        StrategyPlugin(
            name="fsdp",
            factory=imported("ups.fsdp._fsdp:fsdp"),
            options=imported("ups.fsdp._options:FSDPOptions"),
            comm_hooks=False,
            instead="strategy.options.reduce_dtype: bf16 (FSDP reduce-scatters in bfloat16)",
            local_passes=False,
            description="FSDP2: parameters, gradients and optimizer state sharded (ZeRO-3, "
            "ZeRO-2 or HSDP)",
        ),
    ]
