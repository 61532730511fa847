"""Tiny GGUF files written with the `gguf` package's writer from tiny transformers models, laid out as
llama.cpp's converter lays them out (tensor names, the Q/K row permutation of llama, 1-D tensors in F32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter, quants

from compiled_spec.training.train_tokenizer import train_byte_level_bpe

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


def write_gguf(directory: Path, architecture: str = "llama", tensor_type: str = "F32", seed: int = 0,
               tie_word_embeddings: bool = False,
               head_count: int | None | str = "model") -> tuple[Path, torch.nn.Module]:
    """Writes directory/model.gguf; returns its path and the transformers model it came from. head_count: what the
    metadata says ("model": the model's; None: nothing)."""
    tokenizer = train_byte_level_bpe([TEXT], 300)
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[architecture]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                        rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=tie_word_embeddings,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
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
        if values.ndim == 1 or quantization == GGMLQuantizationType.F32:
            writer.add_tensor(llama_cpp_name(name), values)
        elif quantization == GGMLQuantizationType.F16:
            writer.add_tensor(llama_cpp_name(name), values.astype(np.float16))
        else:
            writer.add_tensor(llama_cpp_name(name), quants.quantize(values, quantization), raw_dtype=quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model
