"""ups-comm-hooks: DDP communication hooks for ups, selected by ``comm_hook: {name: ...}``.

- ``bf16`` and ``fp16``: :func:`compress_hook`, gradients all-reduced in 16 bits, on any
  backend (gloo included).
"""

from ._compress import (
    CompressionHook,
    CompressionState,
    bf16_compression,
    compress_hook,
    fp16_compression,
)

__all__ = [
    "CompressionHook",
    "CompressionState",
    "bf16_compression",
    "compress_hook",
    "fp16_compression",
]
