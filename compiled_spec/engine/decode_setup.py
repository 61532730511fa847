"""What an engine allocates once: its decode state, the step's constants, and its batch and prefill buckets."""

from __future__ import annotations

import torch

from ..config import EngineConfig, GraphMode
from ..hisparse.backend import HiSparseAttention
from ..hisparse.indexer import index_key_dims
from ..model.causal_lm import CausalLM
from ..model.rope import rotary_tables
from ..speculative.attention_backend import DenseAttention
from ..speculative.state import DecodeState
from ..speculative.step import StepConstants
from .buckets import checked_buckets, compiled_prefill_limit, default_batch_buckets, default_prefill_buckets


def allocate_state(model: CausalLM, config: EngineConfig) -> DecodeState:
    device, dtype, hisparse = torch.device(config.device), config.torch_dtype(), config.hisparse
    max_drafts, drafter = config.max_drafts, config.drafter or "mtp"
    return DecodeState.allocate(
        model.config, config.max_batch_size, config.max_seq_len, max_drafts, dtype, device,
        tree_width=config.tree_width, drafter=drafter, max_logprobs=config.max_logprobs,
        structured_output=config.structured_output,
        **(dict(hot_rows=hisparse.hot_rows, index_dims=index_key_dims(model, max_drafts if drafter == "mtp" else 0),
                cold_dtype=hisparse.cold_torch_dtype(dtype), pinned_cold_pool=hisparse.cold_pool_pinned(device))
           if hisparse else {}),
    )


def step_constants(model: CausalLM, config: EngineConfig, state: DecodeState, eos_ids: tuple[int, ...]) -> StepConstants:
    device, dtype = torch.device(config.device), config.torch_dtype()
    cos, sin = rotary_tables(model.config, state.cache_capacity)
    return StepConstants(
        rope_cos=cos.to(device=device, dtype=dtype),
        rope_sin=sin.to(device=device, dtype=dtype),
        eos_ids=torch.tensor(eos_ids, dtype=torch.int64, device=device),
        max_seq_len=config.max_seq_len,
        opaque_attention=config.graph_mode == GraphMode.PIECEWISE,
        attention=HiSparseAttention(config.hisparse) if config.hisparse else DenseAttention(),
        draft_tree=config.draft_tree or (),
        drafter=config.drafter or "mtp",
    )


def batch_buckets(config: EngineConfig) -> list[int]:
    return checked_buckets(
        config.batch_buckets or default_batch_buckets(config.max_batch_size), config.max_batch_size, "batch_buckets"
    )


def prefill_buckets(config: EngineConfig) -> list[int]:
    """A prompt longer than the largest prefill bucket prefills in eager at its own length (Engine.admit)."""
    compiled_limit = compiled_prefill_limit(torch.device(config.device).type, config.graph_mode)
    return checked_buckets(
        config.prefill_buckets or default_prefill_buckets(config.max_seq_len, compiled_limit), config.max_seq_len,
        "prefill_buckets", largest_below_limit=True,
    )
