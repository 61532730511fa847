"""Tiny random checkpoints written by transformers (save_pretrained, fp32), with MTP weights added.

MTP modules are built with transformers' own MtpLayer around the architecture's decoder layer, so
their weights and semantics come from code nobody here wrote; they are stored in one of the MTP
layouts real checkpoints use.
"""

from __future__ import annotations

import copy
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
    config = copy.deepcopy(model.config)
    if getattr(config, "layer_types", None) is not None:
        # Qwen2/Qwen3 decoder layers look up their attention type by index; MTP blocks use full attention.
        config.layer_types = list(config.layer_types) + ["full_attention"] * (num_modules + 1)
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
    """MtpLayer weights under the key names of `layout`: deepseek, mimo, mtp-indexed, mtp-flat."""
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
            elif layout == "mtp-flat":  # Qwen3-Next: one module
                if len(layers) != 1:
                    raise ValueError("the mtp-flat layout holds one MTP module")
                names = {
                    "enorm.weight": "pre_fc_norm_embedding.weight",
                    "hnorm.weight": "pre_fc_norm_hidden.weight",
                    "eh_proj.weight": "fc.weight",
                    "post_norm.weight": "norm.weight",
                }
                key = f"mtp.{names[rest]}" if rest in names else f"mtp.layers.0.{rest}"
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


def mimic_main_model(model, layers: list[MtpLayer], noise: float, seed: int = 2) -> None:
    """Makes every MTP module a near copy of the main model's single decoder layer, so drafts are mostly right.

    With eh_proj = [I | small] and enorm scaled to the (equalised) embedding norm, depth m row i computes
    roughly what the main model computes at row i+m, and predicts what the main model will. Attention still
    matters (its output is only damped), so KV mistakes in either cache change the logits.
    """
    if model.config.num_hidden_layers != 1:
        raise ValueError("mimic_main_model needs a one-layer main model")
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)

    def jitter(tensor):
        return tensor + noise * tensor.abs().mean() * torch.randn(tensor.shape, generator=generator)

    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        rms = embeddings.pow(2).mean(-1, keepdim=True).sqrt()
        embeddings.mul_(rms.mean() / rms)
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.3)
        block_state = model.model.layers[0].state_dict()
        for layer in layers:
            layer.enorm.weight.fill_(rms.mean().item())
            layer.hnorm.weight.fill_(1.0)
            layer.post_norm.weight.copy_(model.model.norm.weight)
            from_hidden = 0.1 * rms.mean() / hidden**0.5 * torch.randn(hidden, hidden, generator=generator)
            projection = torch.cat([torch.eye(hidden), from_hidden], dim=1)
            if getattr(layer.config, "mtp_hidden_states_first", False):
                projection = projection.roll(hidden, dims=1)
            layer.eh_proj.weight.copy_(projection)
            layer.mtp_block.load_state_dict({name: jitter(tensor) for name, tensor in block_state.items()})


def write_checkpoint(
    directory: Path,
    architecture: str = "llama",
    num_mtp_modules: int = 2,
    layout: str = "deepseek",
    seed: int = 0,
    max_shard_size: str | None = None,
    mtp_noise: float | None = None,
    **overrides,
):
    """Writes a tiny checkpoint; returns (transformers model, list of MtpLayer).

    max_shard_size: save sharded (model.safetensors.index.json), MTP weights in a shard of their own.
    mtp_noise: None for random MTP modules; a float for modules that mimic the main model (see
    mimic_main_model; needs num_hidden_layers=1), so drafts are often accepted.
    """
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
    layers = build_mtp_layers(model, num_mtp_modules, seed + 1) if num_mtp_modules else []
    for layer in layers:
        # MiMo concatenates [hidden, embedding]; transformers' MtpLayer reads this flag.
        layer.config.mtp_hidden_states_first = layout == "mimo"
    if mtp_noise is not None:
        mimic_main_model(model, layers, mtp_noise, seed + 2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if layers:
        extra_weights = _expert_keys(mtp_state_dict(layers, layout, config.num_hidden_layers))
        index_file = directory / "model.safetensors.index.json"
        if index_file.is_file():
            save_file(extra_weights, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
            index = json.loads(index_file.read_text())
            index["weight_map"].update({key: "model-mtp.safetensors" for key in extra_weights})
            index_file.write_text(json.dumps(index, indent=2))
        else:
            weights_file = directory / "model.safetensors"
            state = _expert_keys(load_file(str(weights_file)))
            save_file({**state, **extra_weights}, str(weights_file), metadata={"format": "pt"})
        raw = json.loads((directory / "config.json").read_text())
        raw["num_nextn_predict_layers"] = num_mtp_modules
        (directory / "config.json").write_text(json.dumps(raw, indent=2))
    return model, layers
