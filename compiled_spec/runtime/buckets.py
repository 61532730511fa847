"""Shape buckets: batches and prompts are padded up to one of a few sizes, each compiled once."""

from __future__ import annotations

import bisect

from ..errors import CompiledSpecError


def default_batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return tuple(sorted({s for s in sizes if s < max_batch_size} | {max_batch_size}))


def default_prefill_buckets(max_seq_len: int) -> tuple[int, ...]:
    sizes, size = [], 16
    while size < max_seq_len:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_seq_len])


def checked_buckets(buckets, limit: int, name: str) -> tuple[int, ...]:
    buckets = tuple(sorted(set(int(b) for b in buckets)))
    if not buckets or buckets[0] < 1 or buckets[-1] != limit:
        raise CompiledSpecError(f"{name}={list(buckets)} must be positive sizes whose largest is {limit}")
    return buckets


def pick_bucket(buckets: tuple[int, ...], size: int) -> int:
    return buckets[bisect.bisect_left(buckets, size)]
