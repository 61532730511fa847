"""A GGUF file (llama.cpp's format) -> the Hugging Face config dict and tensors that loading/checkpoint.py loads.

Read with the `gguf` package. Quantized matrices stay quantized: repacked once into the layout of
model/packed_linear.py (loading/quantized_weights.py); with dequantize=True, and for float types, tensors are read as
float32 and the loader casts them to the engine's dtype. llama.cpp's converter permutes the rows of llama-architecture Q and K
projections (to interleave RoPE pairs); that permutation is undone so the weights are Hugging Face's again.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import CompiledSpecError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# GGUF metadata key (after "<arch>.") -> config.json key.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# GGUF tensor name (in blk.N.) -> Hugging Face name (in model.layers.N.).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and not path.is_dir()


def _reader(path: Path):
    from gguf import GGUFReader, GGUFValueType

    class ArraysUnread(GGUFReader):
        """gguf's reader, except that an array field's items are stepped over, not read: the tokenizer's arrays
        (tokens, merges) would each become numpy views, small Python objects whose freed space the loaded model's
        objects then pin, page by page, for good (docs/models.md). Such a field keeps only its type and length
        parts."""

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            offs, count, item = orig_offs + 12, int(length[0]), GGUFValueType(int(item_type[0]))
            if item == GGUFValueType.STRING:
                order = ">" if (self.byte_order == "S") == (sys.byteorder == "little") else "<"
                sizes = struct.Struct(order + "Q")
                for _ in range(count):
                    offs += 8 + sizes.unpack_from(self.data.base, offs)[0]
            elif item in self.gguf_scalar_to_np:
                offs += count * np.dtype(self.gguf_scalar_to_np[item]).itemsize
            else:  # nested arrays: read as gguf reads them
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, [item_type, length], [], [GGUFValueType.ARRAY, item]

    if not path.is_file():
        raise CompiledSpecError(f"GGUF file {str(path)!r} does not exist")
    try:
        return ArraysUnread(str(path))
    except Exception as error:  # gguf raises ValueError, struct.error or IndexError on a truncated file
        raise CompiledSpecError(f"cannot read {path.name}: the GGUF file is truncated or corrupt ({error})") from None


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def check_head_counts(reader, architecture: str, path: Path) -> None:
    """The attention head counts must be positive and split every Q / K projection's rows into whole heads (in
    pairs for llama, whose rows are un-permuted per head); otherwise loading fails later with no useful message."""
    key = f"{architecture}.attention.head_count"
    heads = field_value(reader, key)
    projections = [tensor for tensor in reader.tensors if tensor.name.startswith("blk.")
                   and tensor.name.split(".")[2:] in (["attn_q", "weight"], ["attn_k", "weight"])]
    if heads is None and not projections:
        return  # nothing to split into heads (the loader names the weights that are missing)
    if not isinstance(heads, int) or heads < 1:
        problem = "is missing" if heads is None else f"is {heads!r}"
        raise CompiledSpecError(f"{path.name}: metadata {key} {problem}; allowed: a positive integer")
    kv_key = f"{key}_kv"
    kv_heads = field_value(reader, kv_key, heads)
    if not isinstance(kv_heads, int) or not 1 <= kv_heads <= heads or heads % kv_heads:
        raise CompiledSpecError(f"{path.name}: metadata {kv_key} is {kv_heads!r}; allowed: a positive divisor of "
                                f"{key} ({heads})")
    pair = 2 if architecture == "llama" else 1
    for tensor in projections:
        count, name = (heads, key) if tensor.name.split(".")[2] == "attn_q" else (kv_heads, kv_key)
        rows = int(tensor.shape[-1])  # GGUF lists dimensions innermost first: [columns, rows]
        if rows % (count * pair):
            raise CompiledSpecError(f"{path.name}: {tensor.name} has {rows} rows, which metadata {name} ({count}) "
                                    f"does not split into whole heads; allowed: a head count dividing {rows // pair}"
                                    + (" (llama: rows per head must be even)" if pair == 2 else ""))


def gguf_config(reader, path: Path) -> dict:
    """config.json's keys, from the file's metadata."""
    architecture = field_value(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise CompiledSpecError(
            f"{path.name}: unsupported GGUF architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    check_head_counts(reader, architecture, path)
    config = {"architectures": [ARCHITECTURES[architecture]], "model_type": architecture}
    for key, hf_key in CONFIG_KEYS.items():
        value = field_value(reader, f"{architecture}.{key}")
        if value is not None:
            config[hf_key] = value
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")  # parts: key length, key, type, item type, length
        config["vocab_size"] = 0 if tokens is None else int(tokens.parts[4][0])
    if "head_dim" not in config and "hidden_size" in config and "num_attention_heads" in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    names = {tensor.name for tensor in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    for hf_key in ("eos_token_id", "bos_token_id"):
        value = field_value(reader, f"tokenizer.ggml.{hf_key}")
        if value is not None:
            config[hf_key] = int(value)
    scaling = field_value(reader, f"{architecture}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = field_value(reader, f"{architecture}.rope.scaling.factor", 1.0)
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
    return config


def hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes llama.cpp's per-head (pair-interleaving) row permutation of a Q or K projection."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_gguf(path: Path, dequantize: bool = False) -> tuple[dict, dict]:
    """(config.json dict, tensors under Hugging Face names): float32, or a PackedMatrix for a quantized matrix
    unless dequantize."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as widen

    from .quantized_weights import PACKED_TYPES, pack

    reader = _reader(path)
    config = gguf_config(reader, path)
    allowed = {getattr(GGMLQuantizationType, name) for name in TENSOR_TYPES}
    permuted = config["model_type"] == "llama"
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        if tensor.tensor_type not in allowed:
            raise CompiledSpecError(
                f"{path.name}: tensor {tensor.name} has quantization type {tensor.tensor_type.name}, which is not "
                f"supported; supported: {', '.join(TENSOR_TYPES)}"
            )
        packed = not dequantize and tensor.tensor_type.name in PACKED_TYPES and len(tensor.data.shape) == 2
        try:
            if packed:
                weight = pack(tensor.data, tensor.tensor_type.name)
            else:  # a copy: F32 data is a read-only memmap
                weight = torch.from_numpy(np.array(widen(tensor.data, tensor.tensor_type), dtype=np.float32))
        except Exception as error:
            raise CompiledSpecError(f"{path.name}: cannot read tensor {tensor.name}; the file is truncated or "
                                    f"corrupt ({error})") from None
        if permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else \
                config.get("num_key_value_heads", config["num_attention_heads"])
            weight = weight.map_rows(lambda part: unpermute_rows(part, heads)) if packed else \
                unpermute_rows(weight, heads)
        tensors[name] = weight
    return config, tensors
