"""Attention of one layer over its tiered KV cache: dense for prefill, sparse for decode passes."""

from __future__ import annotations

import torch

from .fused import hisparse_attention
from .reference import sparse_attention
from .tiers import LayerTiers


def tiered_attention(attention, x, q, k, v, layout, key_cache, value_cache, tiers: LayerTiers, dense) -> torch.Tensor:
    """Writes this pass's index keys, then attends: q [B, T, H, D] -> [B, T, H, D].

    Dense passes (prefill) write k, v straight into the cold pool and attend over it with `dense`.
    Sparse passes (layout.hisparse set) leave the cold pool to mirror_new_rows and run the sparse
    attention: the decomposed reference, or the fused op where the graph mode wants attention opaque.
    """
    slot_ids, write_index = layout.slot_ids, layout.write_index
    index_q, index_w, index_k = attention.indexer(x, q, k, layout)
    tiers.index_keys.index_put_((slot_ids[:, None], write_index), index_k.to(tiers.index_keys.dtype))
    if layout.hisparse is None:
        return dense(q, k, v, key_cache, value_cache, slot_ids, write_index, layout.attend, layout.slots_are_prefix)

    batch = q.shape[0]

    def rows(buffer):
        return buffer[:batch] if layout.slots_are_prefix else buffer[slot_ids]

    trash = key_cache.shape[1] - 1
    write_positions = torch.where(write_index != trash, write_index, -1)
    clock = layout.positions.max(1).values + 1
    live = (write_positions >= 0).any(1)
    top_k = min(layout.hisparse.top_k_tokens, key_cache.shape[1])
    sparse = hisparse_attention if layout.opaque_attention else sparse_attention
    out, *updated = sparse(
        q, k, v, index_q, index_w, rows(tiers.index_keys), rows(key_cache), rows(value_cache),
        rows(tiers.hot_keys), rows(tiers.hot_values), rows(tiers.hot_positions), rows(tiers.hot_last_used),
        write_positions, layout.attend[:, 0], clock, live, top_k,
    )
    for buffer, value in zip(tiers[1:], updated):
        buffer.index_copy_(0, slot_ids, value)
    return out
