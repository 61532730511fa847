"""The ops of the CPU kernel build (decode_attention.load): their schemas and fake implementations, defined before the
build registers its kernels for them. The kernels' sources are decode_attention.cpp and half_weight_linear.cpp."""

from __future__ import annotations

import torch

torch.library.define(
    "compiled_spec_cpu::decode_attention", "(Tensor q, Tensor keys, Tensor values, Tensor attend) -> Tensor"
)


@torch.library.register_fake("compiled_spec_cpu::decode_attention")
def _(q, keys, values, attend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


torch.library.define("compiled_spec_cpu::half_weight_linear", "(Tensor x, Tensor weight) -> Tensor")


@torch.library.register_fake("compiled_spec_cpu::half_weight_linear")
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
