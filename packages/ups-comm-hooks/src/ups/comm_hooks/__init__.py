"""ups-comm-hooks: DDP communication hooks for ups, selected by ``comm_hook: {name: ...}``.

- ``allreduce``, ``bf16`` and ``fp16``: :func:`compress_hook`, gradients all-reduced as they
  are or in 16 bits, on any backend (gloo included).
- ``powersgd`` and ``batched_powersgd``: :func:`powersgd_compression` (torch's PowerSGD hook)
  and :func:`batched_powersgd_compression` (each bucket compressed as one matrix), with a
  :class:`PowerSGDHookState` whose ``state_dict`` and ``load_state_dict`` resume them exactly,
  and optionally 16-bit on the wire (``wire_dtype``).
- ``topk``: :func:`topk_compression`, top-k sparsification with error feedback, kept per
  parameter so that :class:`TopKState` resumes bitwise.

Every hook counts the bytes it hands to collectives (:class:`Traffic`); the engine reports them
per step next to plain all-reduce's, and with ``profile: true`` each bucket's time and bytes.

In a loop of one's own, :func:`register_hook` registers a hook by name on a DDP model and returns
its state (see docs/own-loop.md).
"""

from typing import TYPE_CHECKING

from ups.core import lazy_exports

if TYPE_CHECKING:
    from ._by_name import register_hook
    from ._compress import (
        CompressionHook,
        CompressionState,
        allreduce,
        bf16_compression,
        compress_hook,
        fp16_compression,
    )
    from ._powersgd import (
        PowerSGDHookState,
        PowerSGDOptions,
        batched_powersgd_compression,
        powersgd_compression,
        powersgd_hook,
    )
    from ._topk import SparseLayout, TopKOptions, TopKState, topk_compression, topk_hook
    from ._traffic import HookOptions, Traffic, register

_EXPORTS = {
    "register_hook": "._by_name",
    "CompressionHook": "._compress",
    "CompressionState": "._compress",
    "allreduce": "._compress",
    "bf16_compression": "._compress",
    "compress_hook": "._compress",
    "fp16_compression": "._compress",
    "PowerSGDHookState": "._powersgd",
    "PowerSGDOptions": "._powersgd",
    "batched_powersgd_compression": "._powersgd",
    "powersgd_compression": "._powersgd",
    "powersgd_hook": "._powersgd",
    "SparseLayout": "._topk",
    "TopKOptions": "._topk",
    "TopKState": "._topk",
    "topk_compression": "._topk",
    "topk_hook": "._topk",
    "HookOptions": "._traffic",
    "Traffic": "._traffic",
    "register": "._traffic",
}

__all__ = [
    "CompressionHook",
    "CompressionState",
    "HookOptions",
    "PowerSGDHookState",
    "PowerSGDOptions",
    "SparseLayout",
    "TopKOptions",
    "TopKState",
    "Traffic",
    "allreduce",
    "batched_powersgd_compression",
    "bf16_compression",
    "compress_hook",
    "fp16_compression",
    "powersgd_compression",
    "powersgd_hook",
    "register",
    "register_hook",
    "topk_compression",
    "topk_hook",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
