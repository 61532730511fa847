"""Rotary position embeddings: inverse frequencies for the scaling types the supported configs use."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq over rotary_dim/2, attention scaling applied to cos and sin)."""
    dim = config.rotary_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(config, dim, base, scaling)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(config: ModelConfig, dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rotary_tables(config: ModelConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..num_positions-1, shape [num_positions, rotary_dim]."""
    inv_freq, attention_scaling = inverse_frequencies(config)
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, head_dim]; cos/sin: [B, T, rotary_dim]. Rotates the first rotary_dim dims (rotate-half)."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * cos + torch.cat([-second, first], dim=-1) * sin
    return torch.cat([rotated, passed], dim=-1)
