"""The tiered KV cache of one layer, and the in-graph steps that keep its tiers consistent.

Cold pool: DecodeState.main_keys/main_values (and draft_keys/draft_values per draft depth), the full
history [slots, capacity, kv_heads, head_dim]. With HiSparse on, decode steps write new rows into the
hot buffer only; `mirror_new_rows` copies them to the cold pool after the pass that wrote them.
Hot buffer: hot_keys/hot_values [slots, hot_rows + 1, kv_heads, head_dim]; hot_positions says which
position each row holds (-1: none), hot_last_used when it was last read or written (LRU). The last
row is the trash row (position -1, never evicted). index_keys [slots, capacity, index_dim] keep one
indexer key per cached token, written by prefill and by every pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .reference import NEVER_EVICT


class LayerTiers(NamedTuple):
    index_keys: torch.Tensor
    hot_keys: torch.Tensor
    hot_values: torch.Tensor
    hot_positions: torch.Tensor
    hot_last_used: torch.Tensor


TIER_FIELDS = LayerTiers._fields


@dataclass(eq=False)
class HiSparseState:
    """HiSparse's part of the decode state (DecodeState.hisparse): one entry per tiered layer, the main layers
    then the draft depths."""

    index_keys: list[torch.Tensor]  # [slots, capacity, index_dim]
    hot_keys: list[torch.Tensor]  # [slots, hot_rows + 1, kv_heads, head_dim]
    hot_values: list[torch.Tensor]
    hot_positions: list[torch.Tensor]  # [slots, hot_rows + 1] int64, -1 = empty
    hot_last_used: list[torch.Tensor]  # [slots, hot_rows + 1] int64, LRU clock


def allocate_tiers(hot_rows, index_dims, num_slots, capacity, kv_heads, head_dim, dtype, device) -> HiSparseState:
    """HiSparse's decode state: one entry per tiered layer (main layers, then draft depths)."""
    count = len(index_dims)
    hot_shape = (num_slots, hot_rows + 1, kv_heads, head_dim)
    last_used = torch.zeros(num_slots, hot_rows + 1, dtype=torch.int64, device=device)
    last_used[:, -1] = NEVER_EVICT
    return HiSparseState(
        index_keys=[torch.zeros(num_slots, capacity, dim, dtype=dtype, device=device) for dim in index_dims],
        hot_keys=[torch.zeros(hot_shape, dtype=dtype, device=device) for _ in range(count)],
        hot_values=[torch.zeros(hot_shape, dtype=dtype, device=device) for _ in range(count)],
        hot_positions=[torch.full((num_slots, hot_rows + 1), -1, dtype=torch.int64, device=device) for _ in range(count)],
        hot_last_used=[last_used.clone() for _ in range(count)],
    )


def layer_tiers(hisparse: HiSparseState, index: int) -> LayerTiers:
    return LayerTiers(*(getattr(hisparse, name)[index] for name in TIER_FIELDS))


def tier_field_names(layers: int) -> list[str]:
    """DecodeState fields HiSparse writes in a pass over the first `layers` tiered layers (for the state-mutation
    pass)."""
    return [f"hisparse.{name}[{i}]" for name in TIER_FIELDS for i in range(layers)]


def reset_hot_rows(hisparse: HiSparseState, slot: torch.Tensor) -> None:
    """Empties the hot buffers of `slot` [1] (a new request starts with everything cold)."""
    for index in range(len(hisparse.hot_keys)):
        tiers = layer_tiers(hisparse, index)
        rows = tiers.hot_positions.shape[1]
        tiers.hot_keys.index_copy_(0, slot, torch.zeros_like(tiers.hot_keys[slot]))
        tiers.hot_values.index_copy_(0, slot, torch.zeros_like(tiers.hot_values[slot]))
        tiers.hot_positions.index_copy_(0, slot, torch.full_like(tiers.hot_positions[slot], -1))
        never = torch.arange(rows, device=slot.device) == rows - 1
        last_used = torch.where(never, NEVER_EVICT, torch.zeros_like(tiers.hot_last_used[slot]))
        tiers.hot_last_used.index_copy_(0, slot, last_used)


def move_row(tiers: LayerTiers, slot_ids, source, target) -> None:
    """The cold pool's row at position `source` [B] was copied to `target` [B] (a token tree's accepted leaf, from its
    scratch row): its index key follows, and so does its hot row, which now holds `target`; a hot row that held
    `target` (the rejected draft's) is emptied, so no later read finds it."""
    moves = (source != target)[:, None]
    tiers.index_keys.index_put_((slot_ids, target), tiers.index_keys[slot_ids, source])
    positions = tiers.hot_positions[slot_ids]
    moved = torch.where(moves & (positions == target[:, None]), -1, positions)
    moved = torch.where(moves & (positions == source[:, None]), target[:, None], moved)
    tiers.hot_positions.index_copy_(0, slot_ids, moved)


def mirror_new_rows(tiers: LayerTiers, cold_keys, cold_values, slot_ids, write_index, trash_position: int) -> None:
    """Backs up the rows a pass wrote into the hot buffer to the cold pool (rows that went nowhere go to the trash)."""
    write_positions = torch.where(write_index != trash_position, write_index, -1)
    hot_positions = tiers.hot_positions[slot_ids]
    match = (hot_positions[:, None, :] == write_positions[:, :, None]) & (write_positions >= 0)[:, :, None]
    row = match.long().argmax(-1)
    cold_index = (slot_ids[:, None], torch.where(match.any(-1), write_index, trash_position))
    for hot, cold in ((tiers.hot_keys, cold_keys), (tiers.hot_values, cold_values)):
        rows = hot[slot_ids[:, None], row]
        cold.index_put_(cold_index, rows.to(cold.dtype))
