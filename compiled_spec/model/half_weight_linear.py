"""Drafts with float16 weights: the MTP modules' matrices and the draft head stored at half the bytes.

A decode step on CPU is bound by the bytes of weights it streams, and each draft depth streams its module and the
draft head. Computation stays in the activations' dtype: compiled fp32 CPU passes multiply with the C++ kernel
(half_weight_linear.cpp, which widens each weight vector as it loads it); eager, CUDA and a process without the
kernel widen the weight in the graph. Lossless either way: the verify pass is untouched, and a draft's q is the
distribution it was sampled from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .layers import MLP, Attention


def half_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias), weight float16.

    Compiled fp32 CPU passes call the kernel for any row count: up to 64 rows it widens each weight vector as it
    multiplies; more (a prefill's drafts) widen a tile of weight rows at a time for ATen's GEMM, so no package keeps
    a float32 copy of the drafts as a constant (docs/cpu-performance.md)."""
    if (torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
            and cpu_kernels.loaded()):
        out = torch.ops.compiled_spec_cpu.half_weight_linear(x, weight)
        return out if bias is None else out + bias
    return F.linear(x, weight.to(x.dtype), bias)


class HalfWeightLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.float16), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return half_weight_linear(x, self.weight, self.bias)


def store_drafts_in_half(model) -> None:
    """The MTP modules' linear layers in float16: projection, attention and MLP (an MoE's router and stacked experts
    keep their dtype). The sub-vocabulary draft head is made in float16 by use_draft_vocab; a model that drafts over
    the whole vocabulary shares the verify pass's head, which stays as it is."""
    for module in model.mtp:
        parents = [module] + [part for part in module.modules() if isinstance(part, (Attention, MLP))]
        for parent in parents:
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, HalfWeightLinear(child))


def draft_weight_dtype(model) -> str | None:
    """The name of the dtype the MTP modules' matrices are stored in (None: no modules)."""
    return str(model.mtp[0].eh_proj.weight.dtype).removeprefix("torch.") if len(model.mtp) else None
