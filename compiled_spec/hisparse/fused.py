"""`compiled_spec::hisparse_attention`: select + resolve + swap + attend as one op.

Same contract and results as reference.sparse_attention (the fusion pass swaps one for the other).
The CPU implementation makes fewer passes over the tiers: residency is resolved through an inverse
map (position -> hot row) instead of comparing every wanted position with every hot row, rows move
as contiguous rows of flattened buffers (new rows and swap-ins land in the hot buffer with one
index_copy_ per tensor), and attention runs as one SDPA call over each query's K gathered rows. The op is functional (it returns new tiers); the caller writes
them back into the persistent buffers, inside the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import NEVER_EVICT, index_scores, select_tokens


def _rows(index, rows):
    return index.view(*index.shape, *([1] * (rows.dim() - 2))).expand(*index.shape, *rows.shape[2:])


def _mark_rows(positions, rows, mark, trash):
    """[B, R+1] bool: True at rows[mark]. Unmarked entries all land on the trash row, which stays False."""
    return torch.zeros_like(positions, dtype=torch.bool).scatter_(1, rows.masked_fill(~mark, trash), mark)


def _fused_cpu(
    q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
    hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k,
):
    batch, length = write_positions.shape
    capacity = index_keys.shape[1]
    slots = hot_positions.shape[1]
    trash = slots - 1
    selected, valid = select_tokens(index_scores(index_q, index_w, index_keys, attend), top_k)

    # Inverse residency map, one column past the cache for "no position" (-1).
    row_ids = torch.arange(slots, device=q.device).expand(batch, slots)
    row_of = torch.full((batch, capacity + 1), -1, dtype=torch.int64, device=q.device)

    def set_rows(positions, rows):
        row_of.scatter_(1, torch.where(positions >= 0, positions, capacity), rows)
        row_of[:, capacity] = -1

    def rows_of(positions):
        return row_of.gather(1, torch.where(positions >= 0, positions, capacity))

    set_rows(hot_positions, row_ids)
    positions, last_used = hot_positions.clone(), hot_last_used.clone()
    clock_column = clock.unsqueeze(1)

    # New rows: in place if resident, else into the least recently used rows.
    writes = write_positions >= 0
    resident_row = rows_of(write_positions)
    missing = writes & (resident_row < 0)
    pinned = _mark_rows(positions, resident_row, resident_row >= 0, trash)
    lru = last_used.masked_fill(pinned, NEVER_EVICT).sort(dim=1, stable=True).indices
    victim = lru.gather(1, (missing.long().cumsum(1) - 1).clamp(min=0))
    write_target = torch.where(missing, victim, resident_row).masked_fill(~writes, trash)
    set_rows(positions.gather(1, write_target).masked_fill(~missing, -1), torch.full_like(write_target, -1))
    positions.scatter_(1, write_target, write_positions)
    last_used.scatter_(1, write_target, clock_column.expand_as(write_target).masked_fill(~writes, NEVER_EVICT))
    set_rows(write_positions, write_target)

    # Selected positions: hits are marked used; misses take LRU rows nobody in this pass uses.
    wanted = selected.reshape(batch, -1).masked_fill(~(valid & live.view(batch, 1, 1)).reshape(batch, -1), -1)
    wanted = wanted.sort(dim=1).values
    unique = torch.cat([wanted[:, :1] >= 0, (wanted[:, 1:] != wanted[:, :-1]) & (wanted[:, 1:] >= 0)], dim=1)
    hit_row = rows_of(wanted)
    hit = unique & (hit_row >= 0)
    hit_rows = _mark_rows(positions, hit_row, hit, trash)
    in_use = hit_rows | (last_used == clock_column)
    lru_key = last_used.masked_fill(in_use, NEVER_EVICT)
    lru = lru_key.sort(dim=1, stable=True).indices
    free = (lru_key < NEVER_EVICT).sum(1, keepdim=True)
    missing = unique & ~hit
    rank = missing.long().cumsum(1) - 1
    fits = missing & (rank < free)
    swap_target = lru.gather(1, rank.clamp(min=0, max=trash)).masked_fill(~fits, trash)
    set_rows(positions.gather(1, swap_target).masked_fill(~fits, -1), torch.full_like(swap_target, -1))
    positions.scatter_(1, swap_target, wanted.masked_fill(~fits, -1))
    last_used.scatter_(1, swap_target, clock_column.expand_as(swap_target).masked_fill(~fits, NEVER_EVICT))
    last_used = torch.where(hit_rows, clock_column, last_used)
    set_rows(wanted.masked_fill(~fits, -1), swap_target)

    # Rows move as contiguous [KVH * D] rows of flattened buffers: one index_copy_ per tensor for new rows and
    # swap-ins together (distinct rows, trash aside), index_select for reads.
    kv_heads, dim = hot_keys.shape[2], hot_keys.shape[3]
    batch_ids = torch.arange(batch, device=q.device)[:, None]
    hot_base, cold_base = batch_ids * slots, batch_ids * capacity
    hot_index = torch.cat([(hot_base + write_target).flatten(), (hot_base + swap_target).flatten()])
    swap_source = (cold_base + wanted.clamp(min=0)).flatten()
    selected_flat = selected.reshape(batch, -1)
    row = rows_of(selected_flat)
    read_hot, read_cold = (hot_base + row.clamp(min=0)).flatten(), (cold_base + selected_flat).flatten()
    resident = (row >= 0).view(-1, 1)
    top = selected.shape[-1]
    out_tiers, attended = [], []
    for hot, new, cold in ((hot_keys, new_keys, cold_keys), (hot_values, new_values, cold_values)):
        hot_rows = hot.reshape(batch * slots, kv_heads * dim).clone()
        cold_rows = cold.reshape(batch * capacity, kv_heads * dim)
        incoming = torch.cat([new.reshape(batch * length, -1).to(hot.dtype), cold_rows.index_select(0, swap_source).to(hot.dtype)])
        hot_rows.index_copy_(0, hot_index, incoming)
        read = torch.where(resident, hot_rows.index_select(0, read_hot), cold_rows.index_select(0, read_cold).to(hot.dtype))
        out_tiers.append(hot_rows.view_as(hot))
        attended.append(read.view(batch * length, top, kv_heads, dim).transpose(1, 2).float())
    keys_hot, values_hot = out_tiers

    # Attention over each query's K rows (GQA: query head h reads KV head h // (H / KVH)).
    heads = q.shape[2]
    out = F.scaled_dot_product_attention(
        q.reshape(batch * length, 1, heads, dim).transpose(1, 2).float(), *attended,
        attn_mask=valid.view(batch * length, 1, 1, top), enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(batch, length, heads, dim).to(q.dtype)
    return out, keys_hot, values_hot, positions, last_used


@torch.library.custom_op("compiled_spec::hisparse_attention", mutates_args=())
def hisparse_attention(
    q: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    index_q: torch.Tensor,
    index_w: torch.Tensor | None,
    index_keys: torch.Tensor,
    cold_keys: torch.Tensor,
    cold_values: torch.Tensor,
    hot_keys: torch.Tensor,
    hot_values: torch.Tensor,
    hot_positions: torch.Tensor,
    hot_last_used: torch.Tensor,
    write_positions: torch.Tensor,
    attend: torch.Tensor,
    clock: torch.Tensor,
    live: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fused_cpu(
        q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
        hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k,
    )


@hisparse_attention.register_fake
def _(q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
      hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k):
    return (torch.empty_like(q), torch.empty_like(hot_keys), torch.empty_like(hot_values),
            torch.empty_like(hot_positions), torch.empty_like(hot_last_used))
