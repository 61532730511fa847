"""Indexers: which past tokens a query attends to.

Both give, per query token, index queries q_h [B, T, Hi, Di], head weights w_h [B, T, Hi] and one
index key k_s [B, T, Di] per token, scored as DeepSeek's lightning indexer does:
I(t, s) = sum_h w_h * ReLU(q_h . k_s)  (compiled_spec/hisparse/reference.py: index_scores).

LightningIndexer has its own small heads, loaded from `*.self_attn.indexer.{wq,wk,weights_proj}.weight`.
KeyScorer is training-free: the layer's own RoPE'd query heads against its keys mean-pooled over
the KV heads, every head weighted equally (w = None). Pooling blurs what each KV head looks for, and ReLU-sum
is not softmax mass, so at small top-k it picks worse tokens than a trained indexer would
(benchmarks/hisparse.py measures what that costs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import CompiledSpecError
from ..loading.checkpoint import safetensors_files, split_weights
from ..loading.gguf_checkpoint import is_gguf
from ..model.rope import apply_rotary

INDEXER_KEY = ".self_attn.indexer."


class LightningIndexer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.wq = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, num_heads, bias=False)

    def forward(self, x, q, k, layout):
        batch, length, _ = x.shape
        index_q = self.wq(x).view(batch, length, self.num_heads, self.head_dim)
        index_k = self.wk(x).view(batch, length, 1, self.head_dim)
        if self.head_dim >= layout.cos.shape[-1]:
            index_q = apply_rotary(index_q, layout.cos, layout.sin)
            index_k = apply_rotary(index_k, layout.cos, layout.sin)
        weights = self.weights_proj(x) * (self.num_heads * self.head_dim) ** -0.5
        return index_q, weights, index_k[:, :, 0]


class KeyScorer(nn.Module):
    """The training-free scorer: no weights of its own."""

    def forward(self, x, q, k, layout):
        return q, None, k.mean(2)


def attention_modules(model) -> dict[str, nn.Module]:
    """Checkpoint-side prefix ('layers.0', 'mtp.1.block') -> the Attention module, main layers first."""
    out = {f"layers.{i}": layer.self_attn for i, layer in enumerate(model.layers)}
    out.update({f"mtp.{j}.block": module.block.self_attn for j, module in enumerate(model.mtp)})
    return out


def read_indexer_weights(path: str | Path, num_layers: int) -> dict[str, dict[str, torch.Tensor]]:
    """Indexer tensors of a checkpoint, by attention prefix: {'layers.0': {'wq.weight': ...}}; none in a GGUF file."""
    if is_gguf(Path(path)):
        return {}
    tensors = {}
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                if INDEXER_KEY in key:
                    tensors[key] = handle.get_tensor(key)
    state, _, _ = split_weights(tensors, num_layers)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        prefix, rest = name.split(INDEXER_KEY)
        out.setdefault(prefix, {})[rest] = tensor
    return out


def attach_indexers(model, path: str | Path, scorer: str) -> None:
    """Gives every attention module (MTP blocks included) an `indexer`."""
    weights = read_indexer_weights(path, model.config.num_hidden_layers) if scorer != "keys" else {}
    parameter = next(model.parameters())
    for prefix, attention in attention_modules(model).items():
        found = weights.get(prefix)
        if scorer == "indexer" and found is None:
            raise CompiledSpecError(
                f"scorer='indexer' needs lightning-indexer weights, but the checkpoint has none for {prefix}; "
                "use scorer='keys' (training-free) or 'auto'"
            )
        if found is None:
            attention.indexer = KeyScorer()
            continue
        try:
            head_dim, hidden = found["wk.weight"].shape
            num_heads = found["weights_proj.weight"].shape[0]
            indexer = LightningIndexer(hidden, num_heads, head_dim)
            indexer.load_state_dict(found, strict=True)
        except (KeyError, RuntimeError, ValueError) as error:
            raise CompiledSpecError(f"indexer weights of {prefix} are incomplete or misshaped: {error}") from None
        attention.indexer = indexer.to(device=parameter.device, dtype=parameter.dtype).requires_grad_(False)


def index_key_dims(model, num_speculative_tokens: int) -> list[int]:
    """Index key width of each tiered layer: main layers, then draft depths 1..k."""
    def width(attention):
        indexer = attention.indexer
        return indexer.head_dim if isinstance(indexer, LightningIndexer) else attention.head_dim

    dims = [width(layer.self_attn) for layer in model.layers]
    modules = len(model.mtp)
    dims += [width(model.mtp[min(depth, modules) - 1].block.self_attn) for depth in range(1, num_speculative_tokens + 1)]
    return dims
