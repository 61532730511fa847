"""Shape buckets: batches and prompts are padded up to one of a few sizes, each compiled once."""

from __future__ import annotations

import bisect

from ..config import GraphMode
from ..errors import CompiledSpecError


def default_batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return tuple(sorted({s for s in sizes if s < max_batch_size} | {max_batch_size}))


# On CPU, in compile and piecewise, a prompt longer than this prefills in eager at its own length instead of in a
# compiled bucket, so start-up compiles 3 prefill graphs instead of 6 at the default max_seq_len. Prefill that long
# is GEMM-bound, and compile and piecewise multiply with ATen's GEMMs as eager does, so a compiled bucket padded to a
# power of two buys little over eager at the exact length (docs/cpu-performance.md, "Prefill").
CPU_COMPILED_PREFILL_LIMIT = 64
# full on CPU compiles one prefill package for every prompt width up to its largest bucket, so a higher limit costs
# that package a wider range, not more graphs. With the changed micro-kernel (micro_gemm_kernel) its package prefills
# faster than eager past 64 tokens (docs/cpu-performance.md, "Prefill", has the figures).
FULL_CPU_COMPILED_PREFILL_LIMIT = 256


def compiled_prefill_limit(device_type: str, graph_mode: GraphMode) -> int | None:
    """The largest default prefill bucket an engine compiles on this device (None: up to max_seq_len)."""
    if device_type != "cpu" or graph_mode == GraphMode.EAGER:
        return None
    return FULL_CPU_COMPILED_PREFILL_LIMIT if graph_mode == GraphMode.FULL else CPU_COMPILED_PREFILL_LIMIT


def default_prefill_buckets(max_seq_len: int, compiled_limit: int | None = None) -> tuple[int, ...]:
    """16, 32, 64, ... and max_seq_len; with compiled_limit, only the sizes up to it (longer prompts prefill eagerly)."""
    sizes, size = [], 16
    while size < max_seq_len:
        sizes.append(size)
        size *= 2
    sizes.append(max_seq_len)
    return tuple(s for s in sizes if compiled_limit is None or s <= compiled_limit)


def checked_buckets(buckets, limit: int, name: str, largest_below_limit: bool = False) -> tuple[int, ...]:
    """Sorted, deduplicated buckets; the largest must be `limit`, or at most `limit` with largest_below_limit."""
    buckets = tuple(sorted(set(int(b) for b in buckets)))
    bad_largest = buckets and (buckets[-1] > limit if largest_below_limit else buckets[-1] != limit)
    if not buckets or buckets[0] < 1 or bad_largest:
        largest = f"at most {limit}" if largest_below_limit else str(limit)
        raise CompiledSpecError(f"{name}={list(buckets)} must be positive sizes whose largest is {largest}")
    return buckets


def pick_bucket(buckets: tuple[int, ...], size: int) -> int:
    return buckets[bisect.bisect_left(buckets, size)]
