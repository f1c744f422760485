"""The ``ups-comm-hooks`` plugin: registers the communication hooks of this distribution.

The hooks' modules (and torch) are imported when the hook is called, not with this module.
"""

from __future__ import annotations

from ups.core import CommHookPlugin, hookimpl


@hookimpl
def ups_comm_hooks() -> list[CommHookPlugin]:
    from ._compress import allreduce, bf16_compression, fp16_compression
    from ._powersgd import PowerSGDOptions, batched_powersgd_compression, powersgd_compression
    from ._topk import TopKOptions, topk_compression
    from ._traffic import HookOptions

    return [
        CommHookPlugin(
            name="allreduce",
            factory=allreduce,
            options=HookOptions,
            description="gradients averaged as DDP does, counted (and timed with profile: true)",
        ),
        CommHookPlugin(
            name="bf16",
            factory=bf16_compression,
            options=HookOptions,
            description="gradients averaged in bfloat16: half the bytes, any backend",
        ),
        CommHookPlugin(
            name="fp16",
            factory=fp16_compression,
            options=HookOptions,
            description="gradients averaged in float16: half the bytes, any backend",
        ),
        CommHookPlugin(
            name="powersgd",
            factory=powersgd_compression,
            options=PowerSGDOptions,
            description="torch's PowerSGD low-rank compression, with a state that resumes exactly",
        ),
        CommHookPlugin(
            name="batched_powersgd",
            factory=batched_powersgd_compression,
            options=PowerSGDOptions,
            description="PowerSGD of each whole bucket as one square matrix: fewer, larger kernels",
        ),
        CommHookPlugin(
            name="topk",
            factory=topk_compression,
            options=TopKOptions,
            description="top-k sparsification with error feedback: about 2*ratio of the bytes",
        ),
    ]
