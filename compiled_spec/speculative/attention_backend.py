"""The seam between the step and how its decode passes attend: dense attention over the KV caches, or HiSparse
(compiled_spec/hisparse/backend.py), chosen once per engine and carried in StepConstants.attention.

The step asks the backend for what each model pass needs besides the caches (`tiers`), tells it when a pass has
written new rows, and asks which decode-state fields it writes. The dense backend needs and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..hisparse.config import HiSparseConfig


class AttentionBackend(Protocol):
    config: HiSparseConfig | None  # what a sparse decode pass's layout carries (PassLayout.hisparse)

    def main_tiers(self, state) -> list | None:
        """Per main layer, what its attention reads besides the KV cache."""

    def draft_tiers(self, state, depth: int):
        """What draft depth `depth` (1-based) reads besides its KV cache."""

    def after_main_pass(self, state, tiers, layout, slot_ids: torch.Tensor) -> None:
        """A decode pass of the main model wrote its new rows."""

    def after_draft_pass(self, state, tiers, depth: int, layout, slot_ids: torch.Tensor) -> None:
        """Draft depth `depth` wrote its new rows."""

    def after_row_moved(self, state, tiers, slot_ids: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """A token tree's accepted leaf: its row moved from cache position `source` to `target` [B] in every main layer
        (rows where the two are equal moved nothing)."""

    def reset_slot(self, state, slot: torch.Tensor) -> None:
        """A prefill starts a new request in `slot` [1]."""

    def state_writes(self, state, depths: int) -> list[str]:
        """DecodeState fields a pass over the main layers and `depths` draft depths writes."""


@dataclass(frozen=True)
class DenseAttention:
    config: None = None

    def main_tiers(self, state) -> None:
        return None

    def draft_tiers(self, state, depth: int) -> None:
        return None

    def after_main_pass(self, state, tiers, layout, slot_ids: torch.Tensor) -> None:
        pass

    def after_draft_pass(self, state, tiers, depth: int, layout, slot_ids: torch.Tensor) -> None:
        pass

    def after_row_moved(self, state, tiers, slot_ids: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        pass

    def reset_slot(self, state, slot: torch.Tensor) -> None:
        pass

    def state_writes(self, state, depths: int) -> list[str]:
        return []
