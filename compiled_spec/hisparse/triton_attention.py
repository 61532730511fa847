"""The CUDA attention of the fused HiSparse op: each query over its K selected rows, in one Triton kernel.

One program per (query, head) streams the query's selected rows in blocks, reading each row where it
lives (the hot buffer if resident, else the cold pool, through the row maps the op computed), with an
online softmax in float32, so no [B*T, K, KVH, D] copy of the selected rows is ever made. The result
equals fused._attend_rows_cpu (SDPA over gathered rows) to float32 rounding, including the zeros SDPA
gives a query with no readable row (a padding lane).

With TRITON_INTERPRET=1 set before triton is imported, the same kernel runs in Triton's interpreter on
CPU tensors, which is how the tests check it on a machine without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sparse_attention_kernel(
    q_ptr, hot_keys_ptr, hot_values_ptr, cold_keys_ptr, cold_values_ptr, hot_read_ptr, cold_read_ptr, valid_ptr,
    out_ptr, scale, top_k,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    query = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (HEADS // KV_HEADS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < DIM
    q = tl.load(q_ptr + (query * HEADS + head) * DIM + dims, mask=dim_ok, other=0.0).to(tl.float32)

    best = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, top_k, BLOCK_K):
        picks = start + tl.arange(0, BLOCK_K)
        in_range = picks < top_k
        hot_row = tl.load(hot_read_ptr + query * top_k + picks, mask=in_range, other=-1)
        cold_row = tl.load(cold_read_ptr + query * top_k + picks, mask=in_range, other=0)
        readable = tl.load(valid_ptr + query * top_k + picks, mask=in_range, other=0) != 0
        hot = (hot_row >= 0)[:, None] & dim_ok[None, :]
        cold = (hot_row < 0)[:, None] & in_range[:, None] & dim_ok[None, :]
        hot_at = (hot_row * KV_HEADS + kv_head)[:, None] * DIM + dims[None, :]
        cold_at = (cold_row * KV_HEADS + kv_head)[:, None] * DIM + dims[None, :]
        keys = (tl.load(hot_keys_ptr + hot_at, mask=hot, other=0.0).to(tl.float32)
                + tl.load(cold_keys_ptr + cold_at, mask=cold, other=0.0).to(tl.float32))
        logits = tl.sum(keys * q[None, :], axis=1) * scale
        logits = tl.where(readable & in_range, logits, float("-inf"))

        new_best = tl.maximum(best, tl.max(logits, axis=0))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # nothing readable yet: keep weights at 0
        weights = tl.exp(logits - shift)
        rescale = tl.exp(best - shift)
        values = (tl.load(hot_values_ptr + hot_at, mask=hot, other=0.0).to(tl.float32)
                  + tl.load(cold_values_ptr + cold_at, mask=cold, other=0.0).to(tl.float32))
        acc = acc * rescale + tl.sum(weights[:, None] * values, axis=0)
        total = total * rescale + tl.sum(weights, axis=0)
        best = new_best

    out = acc / tl.where(total > 0, total, 1.0)  # nothing readable: 0, as SDPA gives for a fully masked row
    tl.store(out_ptr + (query * HEADS + head) * DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def attend_rows(q, hot_keys, hot_values, cold_keys, cold_values, hot_read, cold_read, valid):
    """q [B, T, H, D]; tiers [rows, KVH, D] after flattening; hot_read/cold_read/valid [B*T, K]. Returns [B, T, H, D]."""
    batch, length, heads, dim = q.shape
    kv_heads = hot_keys.shape[-2]
    top_k = hot_read.shape[1]
    out = torch.empty_like(q)
    _sparse_attention_kernel[(batch * length, heads)](
        q.contiguous(), hot_keys.contiguous(), hot_values.contiguous(), cold_keys.contiguous(),
        cold_values.contiguous(), hot_read.contiguous(), cold_read.contiguous(), valid.to(torch.int8).contiguous(),
        out, dim**-0.5, top_k,
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim,
        BLOCK_K=min(64, triton.next_power_of_2(top_k)), BLOCK_D=triton.next_power_of_2(dim),
    )
    return out
