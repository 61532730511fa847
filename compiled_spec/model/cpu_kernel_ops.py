"""The ops of the CPU kernel build (cpu_kernels.load): their schemas and fake implementations, defined before the
build registers its kernels for them. The kernels' sources are cpu_kernels.SOURCES."""

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


torch.library.define("compiled_spec_cpu::packed_linear_4bit",
                     "(Tensor x, Tensor nibbles, Tensor scales, Tensor mins) -> Tensor")
torch.library.define("compiled_spec_cpu::packed_linear_8bit", "(Tensor x, Tensor values, Tensor scales) -> Tensor")


@torch.library.register_fake("compiled_spec_cpu::packed_linear_4bit")
def _(x, nibbles, scales, mins):
    return x.new_empty(*x.shape[:-1], nibbles.shape[0])


@torch.library.register_fake("compiled_spec_cpu::packed_linear_8bit")
def _(x, values, scales):
    return x.new_empty(*x.shape[:-1], values.shape[0])
