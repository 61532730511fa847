"""Decoder building blocks: RMSNorm, GQA attention over a static KV cache, SwiGLU MLP, MoE."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..hisparse.attention import tiered_attention
from ..hisparse.config import HiSparseConfig
from . import cpu_kernels
from .rope import apply_rotary


class PassLayout(NamedTuple):
    """Where the rows of one forward pass live: shared by every attention layer of that pass.

    slot_ids: [B] cache slot of each batch row.
    write_index: [B, T] cache position each row's key/value is written to (the trash position for
        rows that must not land anywhere real: padding, rows before the start of the sequence).
    attend: [B, 1, T, S] bool, which of the first S cache positions each row may attend to (S: the cache's
        length, or a prefill's prompt width: no row attends past it).
    cos, sin: [B, T, rotary_dim] rotary tables gathered at the rows' positions.
    slots_are_prefix: the batch is slots 0..B-1, so the cache is read as a view instead of a gather.
    opaque_attention: run cache write + attention as one custom op the compiler does not look into
        (the `piecewise` graph mode splits its graphs there).
    """

    slot_ids: torch.Tensor
    write_index: torch.Tensor
    attend: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots_are_prefix: bool
    opaque_attention: bool = False
    # HiSparse: the config when this is a sparse decode pass, and the rows' (clamped) positions.
    hisparse: HiSparseConfig | None = None
    positions: torch.Tensor | None = None


def attend_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    write_index: torch.Tensor,
    attend: torch.Tensor,
    slots_are_prefix: bool,
) -> torch.Tensor:
    """Writes k, v [B, T, kv_heads, D] into the caches, then attends q [B, T, heads, D] over them: over the cache
    positions attend [B, 1, T, S] covers, the first S (a prefill's mask covers only its prompt)."""
    batch, attended = q.shape[0], attend.shape[-1]
    cache_rows = (slot_ids[:, None], write_index)
    key_cache.index_put_(cache_rows, k.to(key_cache.dtype))
    value_cache.index_put_(cache_rows, v.to(value_cache.dtype))
    if slots_are_prefix:
        keys, values = key_cache[:batch, :attended], value_cache[:batch, :attended]
    else:
        keys, values = key_cache[slot_ids, :attended], value_cache[slot_ids, :attended]
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a compact HiSparse cold pool is widened to read
    if torch.compiler.is_compiling() and q.device.type == "cpu":
        if cpu_kernels.loaded() and q.dtype == torch.float32 and q.shape[1] <= DECODE_ATTENTION_MAX_ROWS:
            return torch.ops.compiled_spec_cpu.decode_attention(q, keys, values, attend)
        if q.shape[1] <= COMPILED_ATTENTION_MAX_ROWS:
            return grouped_attention(q, keys, values, attend)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=attend, enable_gqa=True
    )
    return out.transpose(1, 2)


# Compiled fp32 CPU passes of at most this many rows per sequence (every verify up to k=8, and the drafts) attend with
# the C++ kernel (decode_attention) once it is built; longer ones, eager and CUDA with SDPA.
DECODE_ATTENTION_MAX_ROWS = 9
# Without the kernel, compiled CPU passes of at most this many rows per sequence attend with grouped_attention; SDPA's
# CPU kernel was faster from about 4-6 rows on (docs/cpu-performance.md, "Attention in compiled decode passes"). Not
# measured on CUDA.
COMPILED_ATTENTION_MAX_ROWS = 3


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
    """SDPA for q [B, T, heads, D] over keys, values [B, S, kv_heads, D] where attend [B, 1, T, S], written as
    products and sums, which inductor compiles into loops over the cache without copying it per query head.

    In eager this materializes a [B, T, S, heads, D] product; compiled, it takes the place of SDPA's CPU kernel for a
    few query rows, where SDPA reads and masks the whole cache (docs/cpu-performance.md, "Attention in compiled
    decode passes").
    """
    batch, length, heads, dim = q.shape
    kv_heads = keys.shape[2]
    grouped = q.reshape(batch, length, 1, kv_heads, heads // kv_heads, dim)
    scores = (grouped * keys[:, None, :, :, None, :]).sum(-1) * dim**-0.5  # [B, T, S, kv_heads, group]
    scores = scores.masked_fill(~attend[:, 0, :, :, None, None], float("-inf"))
    weights = scores.softmax(dim=2)
    out = (weights[..., None] * values[:, None, :, :, None, :]).sum(2)  # [B, T, kv_heads, group, D]
    return out.reshape(batch, length, heads, dim)


@torch.library.custom_op("compiled_spec::cached_attention", mutates_args=("key_cache", "value_cache"))
def cached_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    write_index: torch.Tensor,
    attend: torch.Tensor,
    slots_are_prefix: bool,
) -> torch.Tensor:
    return attend_with_cache(q, k, v, key_cache, value_cache, slot_ids, write_index, attend, slots_are_prefix).contiguous()


@cached_attention_op.register_fake
def _(q, k, v, key_cache, value_cache, slot_ids, write_index, attend, slots_are_prefix):
    return torch.empty_like(q)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.indexer = None  # set by compiled_spec.hisparse.indexer.attach_indexers when HiSparse is on

    def forward(self, x: torch.Tensor, layout: PassLayout, key_cache: torch.Tensor, value_cache: torch.Tensor, tiers=None):
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, layout.cos, layout.sin)
        k = apply_rotary(k, layout.cos, layout.sin)
        attention = cached_attention_op if layout.opaque_attention else attend_with_cache
        if tiers is not None:
            out = tiered_attention(self, x, q, k, v, layout, key_cache, value_cache, tiers, dense=attention)
        else:
            out = attention(
                q, k, v, key_cache, value_cache, layout.slot_ids, layout.write_index, layout.attend, layout.slots_are_prefix
            )
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts (sigmoid or softmax scores, group-limited top-k, correction bias) plus shared experts.

    Routing as GLM-4.5 and DeepSeek-V3 define it. Expert weights are stacked: gate_up [E, 2I, H], down [E, H, I].
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.num_expert_groups
        self.topk_groups = config.topk_groups
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.scoring_func = config.scoring_func
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(experts))
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inner))
        shared = inner * config.num_shared_experts
        self.shared_experts = MLP(hidden, shared) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores + self.gate.e_score_correction_bias
        tokens = x.shape[0]
        group_scores = choice.view(tokens, self.num_groups, -1).topk(2, dim=-1).values.sum(-1)
        group_idx = group_scores.topk(self.topk_groups, dim=-1).indices
        group_mask = F.one_hot(group_idx, self.num_groups).sum(1).bool()
        expert_mask = group_mask[:, :, None].expand(-1, -1, self.num_experts // self.num_groups).reshape(tokens, -1)
        choice = choice.masked_fill(~expert_mask, 0.0)
        topk_idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return topk_idx, weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_idx, weights = self.route(x)
        weights = weights.to(x.dtype)
        if x.shape[0] * self.top_k <= self.num_experts:
            # Few tokens: gather only the chosen experts' weights.
            gate, up = torch.einsum("nh,nkih->nki", x, self.experts_gate_up[topk_idx]).chunk(2, dim=-1)
            per_expert = torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, self.experts_down[topk_idx])
            routed = (per_expert * weights[:, :, None]).sum(1)
        else:
            # Many tokens: run every expert densely and weight by the routing (zero for unchosen experts).
            dense_weights = (F.one_hot(topk_idx, self.num_experts).to(x.dtype) * weights[:, :, None]).sum(1)
            gate, up = torch.einsum("nh,eih->eni", x, self.experts_gate_up).chunk(2, dim=-1)
            per_expert = torch.einsum("eni,ehi->enh", F.silu(gate) * up, self.experts_down)
            routed = torch.einsum("enh,ne->nh", per_expert, dense_weights)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.layer_is_moe(layer_index):
            self.mlp = MoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, layout: PassLayout, key_cache: torch.Tensor, value_cache: torch.Tensor, tiers=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layout, key_cache, value_cache, tiers)
        return x + self.mlp(self.post_attention_layernorm(x))
