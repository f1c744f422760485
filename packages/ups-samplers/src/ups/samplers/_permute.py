"""A keyed permutation of ``range(size)`` that gives any of its positions without the rest.

``torch.randperm`` builds all ``size`` values to give one: a rank that needs an eighth of an
epoch pays for all of it, and a task drawn part-way through a pass pays for the whole pass.
:func:`shuffled` is a Feistel network (four rounds of a multiply-xorshift mix) on the fewest
even number of bits that hold ``size``, made a permutation of ``range(size)`` by cycle walking
(applied again while the value is ``>= size``), the construction of format-preserving
encryption and of grain's ``index_shuffle``. Vectorised: O(positions), whatever the size.
"""

from __future__ import annotations

import hashlib

import torch

MASK31 = 2**31 - 1
ROUNDS = 4
CHUNK = 1 << 16


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit hash of 31-bit non-negative values (no product leaves int64's range)."""
    x = x * 0x5BD1E995
    x = (x ^ (x >> 29)) & MASK31
    x = x * 0x2C1B3C6D
    return (x ^ (x >> 31)) & MASK31


def round_constants(seed: tuple[int, ...]) -> list[int]:
    """The rounds' 31-bit constants for ``seed``."""
    digests = (
        hashlib.blake2b(repr((*seed, r)).encode(), digest_size=4).digest() for r in range(ROUNDS)
    )
    return [int.from_bytes(digest, "little") & MASK31 for digest in digests]


def shuffled(
    where: torch.Tensor, size: int, seed: tuple[int, ...], salt: torch.Tensor | int = 0
) -> torch.Tensor:
    """Positions ``where`` (each in ``range(size)``) of the permutation of ``range(size)``
    drawn for ``(*seed, salt)``; ``salt`` (>= 0) is one int, or one per position (one
    permutation each, as the passes of a stream). int64, of ``where``'s shape.

    :raises ValueError: for a size below 0 or beyond 2**62.
    """
    if not 0 <= size <= 2**62:
        raise ValueError(f"size: {size} is not allowed; 0 .. 2**62")
    constants = round_constants(seed)
    bits = max(size - 1, 0).bit_length()
    every_salt = torch.as_tensor(salt, dtype=torch.int64)
    out = torch.empty(len(where), dtype=torch.int64)
    for start in range(0, len(where), CHUNK):  # a chunk's temporaries stay in the cache
        value = where[start : start + CHUNK].to(torch.int64)
        salts = every_salt
        if salts.dim():
            salts = salts[start : start + CHUNK]
            if bool((salts == salts[0]).all()):  # one permutation: keys are numbers
                salts = salts[0]
        keys = [mix((salts & MASK31) ^ constant) for constant in constants]
        value = _feistel(value, keys, bits)
        todo = (value >= size).nonzero().squeeze(1)  # cycle walking: about half, then fewer
        while len(todo):
            value[todo] = step = _feistel(
                value[todo], [k[todo] if k.dim() else k for k in keys], bits
            )
            todo = todo[step >= size]
        out[start : start + CHUNK] = value
    return out


def _feistel(x: torch.Tensor, keys: list[torch.Tensor], bits: int) -> torch.Tensor:
    """The network over ``bits``-bit values: each round moves the low part up and replaces
    it with the high part xor a hash of the low part (halves of unequal width alternate)."""
    low = bits // 2
    for key in keys:
        high = bits - low
        x = ((x & ((1 << low) - 1)) << high) | (
            (x >> low) ^ (mix((x & ((1 << low) - 1)) ^ key) & ((1 << high) - 1))
        )
        low = high
    return x
