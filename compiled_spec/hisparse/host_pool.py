"""The cold pool in pinned host memory that GPU kernels read and write in place (CUDA).

A long context's KV history is what outgrows GPU memory, and HiSparse reads only the few rows a step
selects, so the cold pool can live in host memory. It is one pinned (page-locked) host buffer, and each
cache is handed to torch as a CUDA tensor over its part of that buffer: with unified addressing a pinned
buffer's host address is also valid on the GPU, so the step's kernels (inductor's, the fused op's Triton
kernel, their cudagraph replays) reach the rows over the bus with no copy and no host sync, and
torch.compile sees an ordinary CUDA tensor (vLLM and SGLang build the same view in C++).
"""

from __future__ import annotations

import math

import torch

from ..errors import CompiledSpecError

_USE_DEVICE = "use HiSparseConfig(cold_pool='device') (--cold-pool device) on this machine"
ALIGNMENT = 256  # bytes; every cache starts aligned, as inductor's and Triton's vector loads assume


class _PinnedRegion:
    """`size` bytes of a pinned host buffer at `offset`, offered as CUDA memory through the CUDA Array
    Interface, which torch.as_tensor wraps without copying."""

    def __init__(self, host: torch.Tensor, offset: int, size: int):
        self.host = host  # the tensors over this region keep the pinned buffer alive
        self.address = host.data_ptr() + offset
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (self.address, False), "version": 2}

    def __del__(self):
        # Kernels may still be in flight on the region; the host allocator must not hand it out before they end.
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()


def pinned_host_caches(shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device) -> list[torch.Tensor]:
    """`count` zeroed CUDA tensors of `shape` and `dtype` whose memory is one pinned host buffer."""
    device = torch.device(device)
    if device.type != "cuda":
        raise CompiledSpecError(f"a cold pool in pinned host memory needs a CUDA device, not {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    nbytes = math.prod(shape) * dtype.itemsize
    stride = -(-nbytes // ALIGNMENT) * ALIGNMENT
    host = torch.zeros(stride * count, dtype=torch.uint8, pin_memory=True)
    caches = []
    for index in range(count):
        region = _PinnedRegion(host, index * stride, nbytes)
        try:
            raw = torch.as_tensor(region, device=device)
        except RuntimeError as error:
            raise CompiledSpecError(f"the GPU cannot address the pinned cold pool ({error}); {_USE_DEVICE}") from None
        if raw.data_ptr() != region.address:
            raise CompiledSpecError(f"torch copied the pinned cold pool to the GPU instead of addressing it; {_USE_DEVICE}")
        caches.append(raw.view(dtype).view(shape))
    return caches
