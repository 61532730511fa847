"""Tiny GGUF files written with the `gguf` package's writer from tiny transformers models, laid out as
llama.cpp's converter lays them out (tensor names, the Q/K row permutation of llama, 1-D tensors in F32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import save_file

from compiled_spec.training.train_tokenizer import train_byte_level_bpe
from tiny_checkpoints import build_mtp_layers, mimic_main_model, mtp_state_dict

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n" * 20


def llama_cpp_name(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        stem, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{LAYER_NAMES[stem]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama Q/K rows."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer (gguf-py has none): per 32 values an unsigned 6-bit scale and min under the
    256-value block's float16 d and dmin; w = d * sc * q - dmin * m."""
    blocks = values.reshape(-1, 8, 32).astype(np.float32)
    low, high = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 1e-8)
    scale, offset = (high - low) / 15, -low
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (offset.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.maximum(d, 1e-12)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(offset / np.maximum(dmin, 1e-12)[:, None]), 0, 63).astype(np.uint8)
    step, shift = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round((blocks + shift[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    scales = np.zeros((len(blocks), 12), dtype=np.uint8)  # the bit layout Q4_K.get_scale_min unpacks
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                          dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return out.reshape(values.shape[0], -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer: per 16 values a signed 8-bit scale under the block's float16 d; w = d * sc * (q - 32)."""
    blocks = values.reshape(-1, 16, 16).astype(np.float32)
    scale = np.maximum(np.abs(blocks).max(-1), 1e-8) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(blocks / (d[:, None] * sc)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(-1, 128)
    qh = ((q >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]).sum(2, dtype=np.uint8).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(values.shape[0], -1)


def quantize(values: np.ndarray, tensor_type: str) -> np.ndarray:
    if tensor_type == "Q4_K":
        return quantize_q4_k(values)
    if tensor_type == "Q6_K":
        return quantize_q6_k(values)
    return quants.quantize(values, getattr(GGMLQuantizationType, tensor_type))


def write_gguf(directory: Path, architecture: str = "llama", tensor_type: str = "F32", seed: int = 0,
               tie_word_embeddings: bool = False, head_count: int | None | str = "model",
               hidden_size: int = 64, num_hidden_layers: int = 2,
               mtp_noise: float | None = None) -> tuple[Path, torch.nn.Module]:
    """Writes directory/model.gguf; returns its path and the transformers model it came from. head_count: what the
    metadata says ("model": the model's; None: nothing). A K-quant type needs hidden_size 256 (its blocks hold 256
    values); matrices whose rows are not whole blocks stay F32. mtp_noise: also writes directory/mtp, two MTP
    modules that mimic the model (tiny_checkpoints.mimic_main_model; needs num_hidden_layers=1), for `mtp=`."""
    tokenizer = train_byte_level_bpe([TEXT], 300)
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[architecture]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=256,
                        rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=tie_word_embeddings,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if mtp_noise is not None:
        layers = build_mtp_layers(model, 2, seed + 1)
        mimic_main_model(model, layers, mtp_noise, seed + 2)
        (directory / "mtp").mkdir()
        save_file({key: tensor.contiguous() for key, tensor in mtp_state_dict(layers, "mtp-indexed", 1).items()},
                  str(directory / "mtp" / "mtp.safetensors"))
    path = directory / "model.gguf"
    writer = GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    if head_count is not None:
        writer.add_head_count(config.num_attention_heads if head_count == "model" else head_count)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(vocab["vocab"].items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == tokenizer.eos_token else 1 for token in tokens])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in vocab["merges"]])
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    quantization = getattr(GGMLQuantizationType, tensor_type)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if architecture == "llama" and ".q_proj." in name:
            values = permute_rows(values, config.num_attention_heads)
        elif architecture == "llama" and ".k_proj." in name:
            values = permute_rows(values, config.num_key_value_heads)
        block = quants.GGML_QUANT_SIZES[quantization][0]
        if values.ndim == 1 or quantization == GGMLQuantizationType.F32 or values.shape[-1] % block:
            writer.add_tensor(llama_cpp_name(name), values)
        elif quantization == GGMLQuantizationType.F16:
            writer.add_tensor(llama_cpp_name(name), values.astype(np.float16))
        else:
            writer.add_tensor(llama_cpp_name(name), quantize(values, tensor_type), raw_dtype=quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model
