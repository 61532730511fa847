"""Tiny random checkpoints written by transformers (save_pretrained, fp32), with MTP weights added.

MTP modules are built with transformers' own MtpLayer around the architecture's decoder layer, so
their weights and semantics come from code nobody here wrote; they are stored in one of the MTP
layouts real checkpoints use.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpLayer

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    eos_token_id=1,
    bos_token_id=0,
)

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        dict(
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
    ),
}


def _decoder_classes(model):
    layer = model.model.layers[-1]
    norm_cls = type(model.model.norm)
    return type(layer), norm_cls


def build_mtp_layers(model, num_modules: int, seed: int = 1) -> list[MtpLayer]:
    """transformers MtpLayer modules for `model`'s architecture, randomly initialised."""
    layer_cls, norm_cls = _decoder_classes(model)
    config = model.config
    torch.manual_seed(seed)
    layers = []
    for index in range(num_modules):
        layer_index = config.num_hidden_layers + index
        if getattr(config, "first_k_dense_replace", None) is not None:
            layer_index = max(layer_index, config.first_k_dense_replace)
        mtp = MtpLayer(config, layer_cls, norm_cls, layer_index).eval()
        with torch.no_grad():
            for name, parameter in mtp.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
                else:
                    parameter.normal_(0.0, config.initializer_range)
        layers.append(mtp)
    return layers


def mtp_state_dict(layers: list[MtpLayer], layout: str, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """MtpLayer weights under the key names of `layout`: deepseek, mimo, mtp-indexed."""
    out = {}
    for index, layer in enumerate(layers):
        for name, tensor in layer.state_dict().items():
            block = name.startswith("mtp_block.")
            rest = name[len("mtp_block."):] if block else name
            if layout == "deepseek":
                rest = {"post_norm.weight": "shared_head.norm.weight"}.get(rest, rest)
                key = f"model.layers.{num_hidden_layers + index}.{rest}"
            elif layout == "mimo":
                rest = {
                    "enorm.weight": "token_layernorm.weight",
                    "hnorm.weight": "hidden_layernorm.weight",
                    "eh_proj.weight": "input_proj.weight",
                    "post_norm.weight": "final_layernorm.weight",
                }.get(rest, rest)
                key = f"model.mtp_layers.{index}.{rest}"
            elif layout == "mtp-indexed":
                rest = {"post_norm.weight": "norm.weight"}.get(rest, rest)
                key = f"mtp.{index}.{rest}"
            else:
                raise ValueError(layout)
            out[key] = tensor.detach().clone().contiguous()
    return out


def _expert_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers keeps fused expert tensors in memory; checkpoints store one tensor per expert."""
    out = {}
    for key, tensor in state.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up[e].contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[key] = tensor
    return out


def write_checkpoint(
    directory: Path,
    architecture: str = "llama",
    num_mtp_modules: int = 2,
    layout: str = "deepseek",
    seed: int = 0,
    **overrides,
):
    """Writes a tiny checkpoint; returns (transformers model, list of MtpLayer)."""
    config_cls, model_cls, extra = ARCHITECTURES[architecture]
    config = config_cls(**{**TINY, **extra, **overrides})
    if architecture == "glm4_moe":
        config.num_nextn_predict_layers = num_mtp_modules
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if architecture == "glm4_moe":
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    layers = build_mtp_layers(model, num_mtp_modules, seed + 1) if num_mtp_modules else []
    if layers:
        weights_file = directory / "model.safetensors"
        state = _expert_keys(load_file(str(weights_file)))
        extra_weights = _expert_keys(mtp_state_dict(layers, layout, config.num_hidden_layers))
        save_file({**state, **extra_weights}, str(weights_file), metadata={"format": "pt"})
        raw = json.loads((directory / "config.json").read_text())
        raw["num_nextn_predict_layers"] = num_mtp_modules
        (directory / "config.json").write_text(json.dumps(raw, indent=2))
    return model, layers
