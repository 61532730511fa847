"""Runs the HiSparse Triton kernel in Triton's interpreter and saves inputs and outputs (for test_triton_attention).

Usage: TRITON_INTERPRET=1 python tests/triton_interpreted.py OUT.pt. The interpreter has to be chosen before
triton is imported, hence a process of its own.
"""

from __future__ import annotations

import sys

import torch

from compiled_spec.hisparse.fused import _attend_rows_triton, _fused
from test_hisparse import tier_case


def op_cases():
    """Whole-op calls: random tier states, some with more wanted rows than fit (read from the cold pool)."""
    for seed in range(6):
        args = tier_case(seed)
        yield args, _fused(*args, _attend_rows_triton)


def attention_cases():
    """The kernel alone: several key blocks with a ragged tail, a head size that is not a power of two, a
    compact (bfloat16) cold pool, rows from both tiers, and a query with nothing readable."""
    generator = torch.Generator().manual_seed(0)
    queries, heads, kv_heads, dim, top, hot_rows, cold_rows = 5, 8, 2, 12, 150, 40, 300
    q = torch.randn(1, queries, heads, dim, generator=generator)
    hot_keys, hot_values = (torch.randn(hot_rows, kv_heads, dim, generator=generator) for _ in range(2))
    cold_keys, cold_values = (torch.randn(cold_rows, kv_heads, dim, generator=generator).bfloat16() for _ in range(2))
    hot_read = torch.randint(0, hot_rows, (queries, top), generator=generator)
    hot_read[torch.rand(queries, top, generator=generator) < 0.4] = -1
    cold_read = torch.randint(0, cold_rows, (queries, top), generator=generator)
    valid = torch.rand(queries, top, generator=generator) < 0.8
    valid[-1] = False
    args = (q, hot_keys, hot_values, cold_keys, cold_values, hot_read, cold_read, valid)
    yield args, _attend_rows_triton(*args)


if __name__ == "__main__":
    torch.save({"op": list(op_cases()), "attention": list(attention_cases())}, sys.argv[1])
