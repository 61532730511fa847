"""Inductor's compile time: what cuts it without changing the compiled code's speed."""

from __future__ import annotations

import functools

from torch._inductor.codegen.common import KernelTemplate

# Inductor inlines a pointwise node into each of its uses until the inlined function has this many ops (default: 50
# on CPU), and lowering evaluates the inlined function again for each use. The sampler's counter-based hash
# (speculative/rng.py) uses every intermediate twice (x ^ (x >> 16)), three mix32 deep, so its expression trees
# doubled per stage: one uniform draw over the vocabulary took 41 s to compile alone (7.6 s for a trivial graph),
# and a default-model step and prefill graph 209 s together. Realized at 16 ops, the draw compiles in 8 s and runs
# as fast, and the two graphs in 124 s.
REALIZE_OPCOUNT_THRESHOLD = 16


def keep_parsed_kernel_templates() -> None:
    """Inductor parses the jinja source of a C++ GEMM template's parts (ten sources) again for every GEMM it renders,
    and renders each GEMM twice: 2800 parses for the default model's step and prefill graphs (140 GEMMs), and more
    with depth. The parsed template depends on the source alone, so it is kept: the two graphs compiled in 106 s
    instead of 124."""
    if not hasattr(KernelTemplate._template_from_string, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(functools.cache(KernelTemplate._template_from_string))
