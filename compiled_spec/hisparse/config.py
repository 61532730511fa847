"""HiSparse options: how many past tokens each query attends to, and how many rows the hot buffer holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CompiledSpecError

SCORERS = ("auto", "indexer", "keys")
COLD_DTYPES = ("float32", "bfloat16", "float16")
COLD_POOLS = ("auto", "host", "device")


@dataclass(frozen=True)
class HiSparseConfig:
    """Sparse attention over a tiered KV cache, for decode steps (prefill stays dense).

    top_k_tokens: past tokens each query attends to, chosen by the indexer score.
    hot_rows: rows of the per-request, per-layer hot buffer (LRU); misses are swapped in from the
        cold pool, which keeps the full history.
    scorer: "indexer" needs lightning-indexer weights in the checkpoint; "keys" is the training-free
        scorer (the layer's own queries against its keys, mean-pooled over KV heads); "auto" uses the
        indexer where the checkpoint has one.
    cold_dtype: dtype of the cold pool (the full KV history), e.g. "bfloat16" to halve its memory; rows
        are rounded when they are backed up and widened again when read. None: the engine's dtype.
    draft_mirror: copy the MTP draft layers' new rows to the cold pool after the drafter writes them.
        Only tests turn it off (it injects the fault behind the acceptance-collapse bug).
    """

    top_k_tokens: int = 64
    hot_rows: int = 128
    scorer: str = "auto"
    cold_dtype: str | None = None
    cold_pool: str = "auto"
    draft_mirror: bool = True

    def validate(self, num_speculative_tokens: int, tree_leaves: int = 0) -> None:
        """tree_leaves: a token tree's extra verify rows (speculative/tree.py), 0 for chains."""
        top_k, hot = self.top_k_tokens, self.hot_rows
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise CompiledSpecError(f"top_k_tokens={top_k!r} is out of range; it must be an integer of at least 1")
        if not isinstance(hot, int) or isinstance(hot, bool) or hot < 1:
            raise CompiledSpecError(f"hot_rows={hot!r} is out of range; it must be an integer of at least 1")
        if hot < top_k:
            raise CompiledSpecError(
                f"hot_rows={hot} is smaller than top_k_tokens={top_k}; the hot buffer must hold one query's selection"
            )
        width = decode_pass_width(num_speculative_tokens, tree_leaves)
        if hot < top_k + width:
            drafts = f"num_speculative_tokens={num_speculative_tokens}" + (
                f" and a token tree's {tree_leaves} leaves" if tree_leaves else "")
            raise CompiledSpecError(
                f"hot_rows={hot} is too small: a decode pass writes up to {width} new rows per layer "
                f"({drafts}) besides the top_k_tokens={top_k} it reads; use hot_rows >= {top_k + width}"
            )
        if self.scorer not in SCORERS:
            raise CompiledSpecError(f"scorer={self.scorer!r} is not known; choose one of: {', '.join(SCORERS)}")
        if self.cold_dtype is not None and self.cold_dtype not in COLD_DTYPES:
            raise CompiledSpecError(
                f"cold_dtype={self.cold_dtype!r} is not supported; choose one of: {', '.join(COLD_DTYPES)}"
            )
        if self.cold_pool not in COLD_POOLS:
            raise CompiledSpecError(f"cold_pool={self.cold_pool!r} is not known; choose one of: {', '.join(COLD_POOLS)}")

    def cold_pool_pinned(self, device: torch.device) -> bool:
        """Whether the cold pool goes in pinned host memory (CUDA only: on CPU it is host memory anyway)."""
        return torch.device(device).type == "cuda" and self.cold_pool != "device"

    def cold_torch_dtype(self, engine_dtype: torch.dtype) -> torch.dtype:
        return engine_dtype if self.cold_dtype is None else getattr(torch, self.cold_dtype)


def decode_pass_width(num_speculative_tokens: int, tree_leaves: int = 0) -> int:
    """Rows the widest decode pass writes per layer: verify writes k+1 (and a tree's leaves), draft depth k re-runs 2k
    (draft-extend)."""
    k = num_speculative_tokens
    return max(k + 1 + tree_leaves, 2 * k)
