"""HiSparse decode attention as plain torch ops: score, select, place new rows, swap in, attend.

`sparse_attention` is one pure function of the tiers of the batch's slots; the caller writes the
updated tiers back. passes/hisparse_fusion.py finds exactly this subgraph in a compiled step and
replaces it with the fused op (compiled_spec/hisparse/fused.py), which must return the same values.

Shapes, per pass of B rows and T query tokens, for one layer:
  q [B, T, H, D], new_keys/new_values [B, T, KVH, D]: this pass's queries and new rows.
  index_q [B, T, Hi, Di], index_w [B, T, Hi] or None (every head weighs 1/sqrt(Hi*Di)), index_keys
    [B, S, Di]: the indexer (S = cache capacity).
  cold_keys/cold_values [B, S, KVH, D]: the cold pool, full history up to the last mirror.
  hot_keys/hot_values [B, R+1, KVH, D], hot_positions/hot_last_used [B, R+1]: the hot buffer. Row R
    is the trash row: it holds position -1 and last-used NEVER_EVICT, absorbs writes that must not land.
  write_positions [B, T]: position each new row goes to, -1 for none (padding, trash).
  attend [B, T, S] bool: which positions each query may read (causal).
  clock [B]: LRU time of this pass (later passes have larger clocks).
  live [B] bool: rows that may change the tiers (done rows only read).

Written for the fusion pass's pattern matcher: no op makes a tensor from nothing (no arange/full;
under freezing those would fold into constants and the graph would no longer have the pattern's
shape), and the index_w=None branch keeps a constant weight tensor out of the graph.
"""

from __future__ import annotations

import torch

NEVER_EVICT = 2**62


def index_scores(index_q, index_w, index_keys, attend):
    """I(t, s) = sum_h w_h * ReLU(q_h . k_s), -inf where s may not be read: [B, T, S] float32."""
    batch, length, heads, dim = index_q.shape
    dots = torch.bmm(index_q.reshape(batch, length * heads, dim).float(), index_keys.float().transpose(1, 2))
    dots = dots.relu().view(batch, length, heads, -1)
    if index_w is None:
        scores = dots.sum(2) * (heads * dim) ** -0.5
    else:
        scores = (dots * index_w.float().unsqueeze(-1)).sum(2)
    return scores.masked_fill(~attend, float("-inf"))


def select_tokens(scores, top_k: int):
    """The top_k positions of each query, in position order, and which of them are readable: [B, T, K] each."""
    values, positions = scores.topk(top_k, dim=-1)
    positions, order = positions.sort(dim=-1)
    valid = values.gather(-1, order) > float("-inf")
    return positions, valid


def _expand_rows(index, rows):
    """index [B, N] -> [B, N, *rows.shape[2:]], for gather/scatter of whole rows along dim 1."""
    return index.view(*index.shape, *([1] * (rows.dim() - 2))).expand(*index.shape, *rows.shape[2:])


def _lookup(hot_positions, positions):
    """Hot row holding each of positions [B, N] ([B, N]) and whether one does."""
    match = hot_positions.unsqueeze(1) == positions.unsqueeze(2)
    return match.long().argmax(-1), match.any(-1)


def place_new_rows(hot_keys, hot_values, hot_positions, hot_last_used, new_keys, new_values, write_positions, clock):
    """Every new row gets a hot row: its own if its position is resident, else the least recently used one."""
    trash = hot_positions.shape[1] - 1
    writes = write_positions >= 0
    match = (hot_positions.unsqueeze(1) == write_positions.unsqueeze(2)) & writes.unsqueeze(2)
    resident, resident_row = match.any(-1), match.long().argmax(-1)
    pinned = match.any(1)
    lru_order = hot_last_used.masked_fill(pinned, NEVER_EVICT).sort(dim=1, stable=True).indices
    missing = writes & ~resident
    rank = missing.long().cumsum(1) - 1
    victim = lru_order.gather(1, rank.clamp(min=0)).masked_fill(~missing, trash)
    target = torch.where(resident, resident_row, victim)
    target_rows = _expand_rows(target, hot_keys)
    hot_keys = hot_keys.scatter(1, target_rows, new_keys.to(hot_keys.dtype))
    hot_values = hot_values.scatter(1, target_rows, new_values.to(hot_values.dtype))
    hot_positions = hot_positions.scatter(1, target, write_positions)
    used = clock.unsqueeze(1).expand_as(write_positions).masked_fill(~writes, NEVER_EVICT)
    hot_last_used = hot_last_used.scatter(1, target, used)
    return hot_keys, hot_values, hot_positions, hot_last_used


def swap_in(hot_keys, hot_values, hot_positions, hot_last_used, cold_keys, cold_values, selected, valid, clock, live):
    """Makes the selected positions resident: misses take LRU rows not used by this pass, copied from the cold pool.

    Misses beyond the free rows stay cold (attention reads them from the cold pool).
    """
    batch = selected.shape[0]
    trash = hot_positions.shape[1] - 1
    wanted = selected.reshape(batch, -1).masked_fill(~(valid & live.view(batch, 1, 1)).reshape(batch, -1), -1)
    wanted = wanted.sort(dim=1).values
    first = torch.cat([wanted[:, :1] >= -1, wanted[:, 1:] != wanted[:, :-1]], dim=1)
    unique = first & (wanted >= 0)
    match = (hot_positions.unsqueeze(1) == wanted.unsqueeze(2)) & unique.unsqueeze(2)
    hit, hit_rows = match.any(-1), match.any(1)
    now = clock.unsqueeze(1)
    in_use = hit_rows | (hot_last_used == now)
    lru_key = hot_last_used.masked_fill(in_use, NEVER_EVICT)
    lru_order = lru_key.sort(dim=1, stable=True).indices
    free = (lru_key < NEVER_EVICT).sum(1, keepdim=True)
    missing = unique & ~hit
    rank = missing.long().cumsum(1) - 1
    fits = missing & (rank < free)
    target = lru_order.gather(1, rank.clamp(min=0, max=trash)).masked_fill(~fits, trash)
    target_rows = _expand_rows(target, hot_keys)
    source_rows = _expand_rows(wanted.clamp(min=0), cold_keys)
    hot_keys = hot_keys.scatter(1, target_rows, cold_keys.gather(1, source_rows).to(hot_keys.dtype))
    hot_values = hot_values.scatter(1, target_rows, cold_values.gather(1, source_rows).to(hot_values.dtype))
    not_fitting = ~fits
    hot_positions = hot_positions.scatter(1, target, wanted.masked_fill(not_fitting, -1))
    hot_last_used = hot_last_used.scatter(1, target, now.expand_as(wanted).masked_fill(not_fitting, NEVER_EVICT))
    hot_last_used = torch.where(hit_rows, now.expand_as(hot_last_used), hot_last_used)
    return hot_keys, hot_values, hot_positions, hot_last_used


def gather_selected(hot_keys, hot_values, hot_positions, cold_keys, cold_values, selected):
    """Keys and values [B, T, K, KVH, D] of the selected positions: from the hot buffer where resident, else cold."""
    batch, length, top_k = selected.shape
    flat = selected.reshape(batch, -1)
    row, resident = _lookup(hot_positions, flat)
    hot_index, cold_index, resident = _expand_rows(row, hot_keys), _expand_rows(flat, cold_keys), _expand_rows(resident, hot_keys)
    shape = (batch, length, top_k, *hot_keys.shape[2:])
    keys = torch.where(resident, hot_keys.gather(1, hot_index), cold_keys.gather(1, cold_index).to(hot_keys.dtype))
    values = torch.where(resident, hot_values.gather(1, hot_index), cold_values.gather(1, cold_index).to(hot_values.dtype))
    return keys.view(shape), values.view(shape)


def attend_selected(q, keys, values, valid):
    """q [B, T, H, D] over its own K rows keys/values [B, T, K, KVH, D] (GQA), masked by valid [B, T, K]."""
    batch, length, heads, dim = q.shape
    kv_heads = keys.shape[3]
    grouped = q.float().view(batch, length, kv_heads, heads // kv_heads, dim)
    logits = torch.matmul(grouped, keys.float().permute(0, 1, 3, 4, 2)) * dim**-0.5
    logits = logits.masked_fill(~valid.view(batch, length, 1, 1, -1), float("-inf"))
    out = torch.matmul(logits.softmax(-1), values.float().permute(0, 1, 3, 2, 4))
    return out.reshape(batch, length, heads, dim).to(q.dtype)


def sparse_attention(
    q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
    hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live, top_k: int,
):
    """Returns (attention output [B, T, H, D], hot_keys, hot_values, hot_positions, hot_last_used)."""
    scores = index_scores(index_q, index_w, index_keys, attend)
    selected, valid = select_tokens(scores, top_k)
    tiers = place_new_rows(hot_keys, hot_values, hot_positions, hot_last_used, new_keys, new_values, write_positions, clock)
    hot_keys, hot_values, hot_positions, hot_last_used = swap_in(
        *tiers, cold_keys, cold_values, selected, valid, clock, live
    )
    keys, values = gather_selected(hot_keys, hot_values, hot_positions, cold_keys, cold_values, selected)
    out = attend_selected(q, keys, values, valid)
    return out, hot_keys, hot_values, hot_positions, hot_last_used
