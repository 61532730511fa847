"""Weights kept quantized in memory: linear layers, the token embedding and a tied head over packed blocks.

Two layouts cover GGUF's Q4_0, Q4_1, Q4_K, Q8_0 and Q6_K (loading/quantized_weights.py repacks them, exactly):
  4-bit: nibbles uint8 [N, K/2], scales and mins per 32-value block [N, K/32]; w = scale * q + min. Blocks
         go in pairs, 32 bytes for 64 values: byte 2l holds value l low and l + 16 high, byte 2l + 1 values l + 32 and
         l + 48 (so 16-bit word l holds values l, l + 16, l + 32, l + 48 from its low nibble up); a row's odd last
         block is 16 bytes, byte l holding value l low and l + 16 high.
  8-bit: int8 values [N, K], scales [N, K/G] with G 16 or 32; w = scale * q.
Scales and mins are float16 where that holds them exactly, else float32.
A CPU float32 pass multiplies with the C++ kernel (packed_linear.cpp, built with the other CPU kernels by
cpu_kernels.py), in eager and in compiled graphs alike: it is a registered op with a fake implementation, so
`full`'s AOTInductor packages call it and keep the packed bytes as their constants. Elsewhere (CUDA, other dtypes,
no kernel) the weight is widened in the graph. The embedding widens only the rows it looks up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """4-bit packed rows [..., K/2] -> their values [..., K] (uint8), in order."""
    pairs = qweight.shape[-1] // 32 * 32
    paired = qweight[..., :pairs].unflatten(-1, (-1, 16, 2))  # [..., pair, l, byte 2l or 2l + 1]
    values = torch.stack([paired[..., 0] & 15, paired[..., 0] >> 4, paired[..., 1] & 15, paired[..., 1] >> 4], -2)
    last = qweight[..., pairs:]
    return torch.cat([values.flatten(-3), last & 15, last >> 4], dim=-1)


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """Packed rows [..., K/2] (4-bit) or [..., K] (8-bit) -> float32 [..., K], as gguf's dequantize computes them."""
    if qweight.dtype == torch.uint8:
        values = unpack_nibbles(qweight).unflatten(-1, (-1, 32)).float()  # [..., K/32, 32]
        return (values * scales[..., None].float() + mins[..., None].float()).flatten(-2)
    group = qweight.shape[-1] // scales.shape[-1]
    return (qweight.unflatten(-1, (-1, group)).float() * scales[..., None].float()).flatten(-2)


def packed_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.loaded():
        if qweight.dtype == torch.uint8:
            return torch.ops.compiled_spec_cpu.packed_linear_4bit(x, qweight, scales, mins)
        return torch.ops.compiled_spec_cpu.packed_linear_8bit(x, qweight, scales)
    return F.linear(x, dequantize_rows(qweight, scales, mins).to(x.dtype))


class PackedLinear(nn.Module):
    """x @ W.T (+ bias) for a weight W [N, K] kept packed. `format` names the type it came from (e.g. Q4_1)."""

    def __init__(self, out_features: int, in_features: int, format: str, four_bit: bool, group: int = 32,
                 bias: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.format = format
        self.out_features, self.in_features = out_features, in_features
        if four_bit:
            self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.empty(out_features, in_features // 32, dtype=scale_dtype))
            self.register_buffer("mins", torch.empty(out_features, in_features // 32, dtype=scale_dtype))
        else:
            self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(out_features, in_features // group, dtype=scale_dtype))
            self.mins = None
        self.bias = bias

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        out = packed_linear(x, self.qweight, self.scales, self.mins)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows at `index`, widened to float32."""
        return dequantize_rows(self.qweight[index], self.scales[index], None if self.mins is None else self.mins[index])

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.format}"


class PackedEmbedding(PackedLinear):
    """An embedding table kept packed: a lookup widens the rows it reads; `linear` is the tied head."""

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(token_ids)


def weight_format(model) -> str:
    """How the main model's matrices are stored: e.g. "Q4_1 packed", "Q4_1+Q8_0 packed", or "float32"."""
    formats = sorted({module.format for module in model.modules() if isinstance(module, PackedLinear)})
    if not formats:
        return str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    return "+".join(formats) + " packed"
