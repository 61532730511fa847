"""HiSparse: sparse attention over a tiered KV cache (cold pool, per-slot LRU hot buffer, indexer)."""

from .config import HiSparseConfig

__all__ = ["HiSparseConfig"]
