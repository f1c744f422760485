"""ups-comm-hooks: DDP communication hooks for ups, selected by ``comm_hook: {name: ...}``.

- ``bf16`` and ``fp16``: :func:`compress_hook`, gradients all-reduced in 16 bits, on any
  backend (gloo included).
- ``powersgd``: :func:`powersgd_compression`, torch's PowerSGD hook with a
  :class:`PowerSGDHookState` whose ``state_dict`` and ``load_state_dict`` resume it exactly.
"""

from ._compress import (
    CompressionHook,
    CompressionState,
    bf16_compression,
    compress_hook,
    fp16_compression,
)
from ._powersgd import PowerSGDHookState, PowerSGDOptions, powersgd_compression, powersgd_hook

__all__ = [
    "CompressionHook",
    "CompressionState",
    "PowerSGDHookState",
    "PowerSGDOptions",
    "bf16_compression",
    "compress_hook",
    "fp16_compression",
    "powersgd_compression",
    "powersgd_hook",
]
