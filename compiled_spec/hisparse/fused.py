"""`compiled_spec::hisparse_attention`: select + resolve + swap + attend as one op.

Same contract and results as reference.sparse_attention (the fusion pass swaps one for the other).
Both devices share the tier bookkeeping, which makes fewer passes over the tiers than the reference:
residency is resolved through an inverse map (position -> hot row) instead of comparing every wanted
position with every hot row, and rows move as contiguous rows of flattened buffers (new rows and
swap-ins land in the hot buffer with one index_copy_ per tensor). Attention over each query's K
selected rows is one SDPA call over gathered rows on CPU, and on CUDA one Triton kernel
(triton_attention.py) that reads each row straight from the hot buffer or the cold pool, with no
gathered copy. The op is functional (it returns new tiers); the caller writes them back into the
persistent buffers, inside the graph.
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


def _fused(
    q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
    hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k, attend_rows,
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
    # swap-ins together (distinct rows, trash aside).
    kv_heads, dim = hot_keys.shape[2], hot_keys.shape[3]
    batch_ids = torch.arange(batch, device=q.device)[:, None]
    hot_base, cold_base = batch_ids * slots, batch_ids * capacity
    hot_index = torch.cat([(hot_base + write_target).flatten(), (hot_base + swap_target).flatten()])
    swap_source = (cold_base + wanted.clamp(min=0)).flatten()
    out_tiers = []
    for hot, new, cold in ((hot_keys, new_keys, cold_keys), (hot_values, new_values, cold_values)):
        hot_rows = hot.reshape(batch * slots, kv_heads * dim).clone()
        cold_rows = cold.reshape(batch * capacity, kv_heads * dim)
        incoming = torch.cat([new.reshape(batch * length, -1).to(hot.dtype), cold_rows.index_select(0, swap_source).to(hot.dtype)])
        hot_rows.index_copy_(0, hot_index, incoming)
        out_tiers.append(hot_rows.view_as(hot))
    keys_hot, values_hot = out_tiers

    # Each selected position is read from its hot row where resident, else from the cold pool.
    selected_flat = selected.reshape(batch, -1)
    row = rows_of(selected_flat)
    hot_read = torch.where(row >= 0, hot_base + row, -1).view(batch * length, -1)
    cold_read = (cold_base + selected_flat).view(batch * length, -1)
    out = attend_rows(q, keys_hot, values_hot, cold_keys, cold_values, hot_read, cold_read, valid)
    return out, keys_hot, values_hot, positions, last_used


def _attend_rows_cpu(q, hot_keys, hot_values, cold_keys, cold_values, hot_read, cold_read, valid):
    """Attention of each query over its K rows: one gather per tier and one SDPA call.

    hot_read/cold_read [B*T, K]: flat row of each selected position in the hot buffer (-1 = not resident)
    and in the cold pool. Returns [B, T, H, D].
    """
    batch, length, heads, dim = q.shape
    kv_heads, top = hot_keys.shape[-2], hot_read.shape[1]
    resident = (hot_read >= 0).view(-1, 1)
    attended = []
    for hot, cold in ((hot_keys, cold_keys), (hot_values, cold_values)):
        hot_rows, cold_rows = hot.reshape(-1, kv_heads * dim), cold.reshape(-1, kv_heads * dim)
        read = torch.where(resident, hot_rows.index_select(0, hot_read.clamp(min=0).flatten()),
                           cold_rows.index_select(0, cold_read.flatten()).to(hot.dtype))
        attended.append(read.view(batch * length, top, kv_heads, dim).transpose(1, 2).float())
    # GQA: query head h reads KV head h // (H / KVH).
    out = F.scaled_dot_product_attention(
        q.reshape(batch * length, 1, heads, dim).transpose(1, 2).float(), *attended,
        attn_mask=valid.view(batch * length, 1, 1, top), enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(batch, length, heads, dim).to(q.dtype)


def _attend_rows_triton(q, hot_keys, hot_values, cold_keys, cold_values, hot_read, cold_read, valid):
    from .triton_attention import attend_rows

    return attend_rows(q, hot_keys, hot_values, cold_keys, cold_values, hot_read, cold_read, valid)


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
    return _fused(
        q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
        hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k,
        _attend_rows_cpu,
    )


@hisparse_attention.register_kernel("cuda")
def _(q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
      hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k):
    return _fused(
        q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
        hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k,
        _attend_rows_triton,
    )


@hisparse_attention.register_fake
def _(q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
      hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k):
    return (torch.empty_like(q), torch.empty_like(hot_keys), torch.empty_like(hot_values),
            torch.empty_like(hot_positions), torch.empty_like(hot_last_used))
