"""HiSparse as the step's attention backend (speculative/attention_backend.py): decode passes attend sparsely over
tiered KV caches whose state is DecodeState.hisparse, and every pass's new rows are mirrored to the cold pool in
the graph, the draft depths' included."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import HiSparseConfig
from .tiers import LayerTiers, layer_tiers, mirror_new_rows, move_row, reset_hot_rows, tier_field_names


@dataclass(frozen=True)
class HiSparseAttention:
    config: HiSparseConfig

    def main_tiers(self, state) -> list[LayerTiers]:
        return [layer_tiers(state.hisparse, i) for i in range(len(state.main_keys))]

    def draft_tiers(self, state, depth: int) -> LayerTiers:
        return layer_tiers(state.hisparse, len(state.main_keys) + depth - 1)

    def after_main_pass(self, state, tiers: list[LayerTiers], layout, slot_ids: torch.Tensor) -> None:
        if layout.hisparse is None:  # a dense pass (prefill) wrote the cold pool itself
            return
        for layer, tiers_of_layer in enumerate(tiers):
            mirror_new_rows(tiers_of_layer, state.main_keys[layer], state.main_values[layer], slot_ids,
                            layout.write_index, state.trash_position)

    def after_draft_pass(self, state, tiers: LayerTiers, depth: int, layout, slot_ids: torch.Tensor) -> None:
        if layout.hisparse is None or not self.config.draft_mirror:
            return
        # The draft mirror: this depth's new rows reach its cold pool before any later pass reads them.
        mirror_new_rows(tiers, state.draft_keys[depth - 1], state.draft_values[depth - 1], slot_ids,
                        layout.write_index, state.trash_position)

    def after_row_moved(self, state, tiers: list[LayerTiers], slot_ids, source, target) -> None:
        for tiers_of_layer in tiers:
            move_row(tiers_of_layer, slot_ids, source, target)

    def reset_slot(self, state, slot: torch.Tensor) -> None:
        reset_hot_rows(state.hisparse, slot)

    def state_writes(self, state, depths: int) -> list[str]:
        return tier_field_names(len(state.main_keys) + depths)
