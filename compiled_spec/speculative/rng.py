"""Counter-based random numbers in plain tensor ops, so sampling traces into a graph.

A uniform is a hash of (request seed, token position, purpose, vocabulary index); the same key gives
the same number in every graph mode and batch. All arithmetic stays below 2**63, so int64 never
overflows, and right shifts only ever see non-negative values.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF

# Purposes: what a uniform is used for at a position. Drafts at depth m use DRAFT + m.
TARGET = 0
ACCEPT = 1
DRAFT = 1


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for 32-bit x, in 16-bit halves so no product exceeds 2**48."""
    low = (x & 0xFFFF) * constant
    high = (((x >> 16) * constant) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash on values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seeds: torch.Tensor, positions: torch.Tensor, purpose: int | torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position, purpose); seeds may use all 64 bits."""
    seed_key = mix32(seeds & MASK32) ^ mix32(((seeds >> 32) & MASK32) ^ 0x5BD1E995)
    return mix32(seed_key ^ mix32((positions * 16 + purpose) & MASK32))


def to_unit(bits: torch.Tensor) -> torch.Tensor:
    """32-bit values -> float32 strictly inside (0, 1).

    23 bits, not 24: (2**24 - 1) + 0.5 rounds up to 2**24 in float32, and a uniform of exactly 1 makes
    the exponential race divide 0 by -log(1) = 0 (a NaN that argmax picks)."""
    return ((bits >> 9).float() + 0.5) / float(1 << 23)


def uniforms(key: torch.Tensor, count: int) -> torch.Tensor:
    """`count` uniforms in (0, 1) per key: shape key.shape + (count,), float32."""
    # The lanes start from a value loaded from memory (key & 0): Inductor before torch 2.13 computes arange
    # arithmetic in a Triton kernel's int32 index type, where 0x9E3779B9 does not fit and the hash's products
    # would wrap.
    lanes = (key[..., None] & 0) + torch.arange(count, device=key.device, dtype=torch.int64)
    return to_unit(mix32(key[..., None] ^ mix32((lanes + 0x9E3779B9) & MASK32)))


def uniform(key: torch.Tensor) -> torch.Tensor:
    return uniforms(key, 1)[..., 0]
