"""Copies of tensors in one block of memory advised to the kernel for transparent huge pages.

A decode step streams every weight once; on 2 MiB pages it takes far fewer TLB misses to do so (measured in
docs/cpu-performance.md, "Weights on huge pages").
Where the kernel offers no huge pages (THP 'never'), the block is plain memory and nothing changes."""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # bytes: what C++ GEMM kernels read pre-packed weights with


def copies_on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor copied, with its shape, strides and storage offset, into one block starting on a huge page."""
    offsets, end = [], 0
    for tensor in tensors:
        end = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(end)
        end += tensor.untyped_storage().nbytes()
    if end == 0:
        return [tensor.clone() for tensor in tensors]
    # Private: a shared anonymous mapping is shmem, which THP's 'madvise' setting leaves on small pages.
    # Over-allocated so that a huge-page boundary falls inside.
    block = mmap.mmap(-1, end + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        block.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(block, dtype=torch.uint8)  # keeps `block` alive as long as any view of it is
    start = -memory.data_ptr() % HUGE_PAGE
    copies = []
    for tensor, offset in zip(tensors, offsets):
        size = tensor.element_size()
        region = memory[start + offset:start + offset + tensor.untyped_storage().nbytes()].view(tensor.dtype)
        copy = region.as_strided(tensor.shape, tensor.stride(), (start + offset) // size + tensor.storage_offset())
        copy.copy_(tensor)
        copies.append(copy)
    return copies
