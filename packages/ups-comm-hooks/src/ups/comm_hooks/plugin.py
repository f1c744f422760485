"""The ``ups-comm-hooks`` plugin: registers the communication hooks of this distribution.

The hooks' modules (and torch) are imported when a hook is selected, not when listed.
"""

from __future__ import annotations

from ups.core import CommHookPlugin, hookimpl, imported


@hookimpl
def ups_comm_hooks() -> list[CommHookPlugin]:
    return [
        CommHookPlugin(
            name="allreduce",
            factory=imported("ups.comm_hooks._compress:allreduce"),
            options=imported("ups.comm_hooks._traffic:HookOptions"),
            description="gradients averaged as DDP does, counted (and timed with profile: true)",
        ),
        CommHookPlugin(
            name="bf16",
            factory=imported("ups.comm_hooks._compress:bf16_compression"),
            options=imported("ups.comm_hooks._traffic:HookOptions"),
            description="gradients averaged in bfloat16: half the bytes, any backend",
        ),
        CommHookPlugin(
            name="fp16",
            factory=imported("ups.comm_hooks._compress:fp16_compression"),
            options=imported("ups.comm_hooks._traffic:HookOptions"),
            description="gradients averaged in float16: half the bytes, any backend",
        ),
        CommHookPlugin(
            name="powersgd",
            factory=imported("ups.comm_hooks._powersgd:powersgd_compression"),
            options=imported("ups.comm_hooks._powersgd:PowerSGDOptions"),
            description="torch's PowerSGD low-rank compression, with a state that resumes exactly",
        ),
        CommHookPlugin(
            name="batched_powersgd",
            factory=imported("ups.comm_hooks._powersgd:batched_powersgd_compression"),
            options=imported("ups.comm_hooks._powersgd:PowerSGDOptions"),
            description="PowerSGD of each whole bucket as one square matrix: fewer, larger kernels",
        ),
        CommHookPlugin(
            name="topk",
            factory=imported("ups.comm_hooks._topk:topk_compression"),
            options=imported("ups.comm_hooks._topk:TopKOptions"),
            description="top-k sparsification with error feedback: about 2*ratio of the bytes",
        ),
    ]
