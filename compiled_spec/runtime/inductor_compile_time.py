"""Inductor's compile time: what cuts it without changing the compiled code's speed."""

from __future__ import annotations

import functools
import hashlib
import re

import sympy
import torch._inductor.compile_fx  # noqa: F401  first: cpp_template_kernel imported on its own is a circular import
from torch._inductor.codecache import AotCodeCompiler
from torch._inductor.codegen import cpp_template_kernel
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


def keep_parsed_index_expressions() -> None:
    """A C++ template kernel parses its index expressions from text with sympy (parse_expr_with_index_symbols) each
    time it renders: the default model's batch-1 k=3 step and 16-token prefill made 5599 such calls over 12 distinct
    texts, 7.2 s of their 164 s compile. The parse depends on the text alone and sympy expressions are immutable, so
    each text is parsed once per process."""
    parse = cpp_template_kernel.parse_expr_with_index_symbols
    if getattr(parse, "keeps_parsed", False):
        return
    parsed_text = functools.cache(parse)

    def parse_once(expr):
        if isinstance(expr, (sympy.Expr, list, tuple)):
            return parse(expr)  # an expression as it is; a sequence element by element, through parse_once
        return parsed_text(str(expr))

    parse_once.keeps_parsed = True
    cpp_template_kernel.parse_expr_with_index_symbols = parse_once


_MICRO_GEMM = re.compile(r"inline void (\w+)_micro_gemm_kernel\(")


def share_micro_gemms(kernel_code: str) -> str:
    """An AOTInductor kernel source with one definition of each distinct micro-GEMM.

    Each C++ GEMM template kernel defines its own micro-GEMM templates, named after the kernel, and instantiates them
    for every row block up to its register blocking (16 unrolled vector kernels each). A graph's GEMMs differ in
    shape, not in their micro-GEMM: the default model's batch-1 k=3 step has 23 GEMM kernels and 2 distinct
    micro-GEMMs, SmolLM2-135M's k=2 step 16 and 2. Their kernel sources compiled in 20-34 s and 26-28 s, and in 8 s
    and 6 s with each micro-GEMM defined once. Each is named after its source here; the source is the same, so what
    is compiled from it is too. A micro-GEMM whose source names anything else of its kernel keeps its own
    definition."""
    defined: set[str] = set()
    pieces, position = [], 0
    for match in _MICRO_GEMM.finditer(kernel_code):
        kernel = match.group(1)
        start = kernel_code.rfind("template <", position, match.start())
        end = kernel_code.find('extern "C"', match.end())
        if start < 0 or end < 0:
            continue
        definition = kernel_code[start:end].replace(f"{kernel}_micro_gemm", "KERNEL_micro_gemm")
        if kernel in definition:
            continue
        name = f"shared_{hashlib.sha256(definition.encode()).hexdigest()[:16]}"
        uses_end = kernel_code.find("\n}\n", end)
        uses_end = len(kernel_code) if uses_end < 0 else uses_end
        pieces.append(kernel_code[position:start])
        if name not in defined:
            pieces.append(definition.replace("KERNEL_micro_gemm", f"{name}_micro_gemm"))
            defined.add(name)
        pieces.append(kernel_code[end:uses_end].replace(f"{kernel}_micro_gemm", f"{name}_micro_gemm"))
        position = uses_end
    pieces.append(kernel_code[position:])
    return "".join(pieces)


def compile_shared_micro_gemms() -> None:
    """Every AOTInductor compile in this process gets its kernel source through share_micro_gemms."""
    compile_library = AotCodeCompiler.compile.__func__
    if getattr(compile_library, "shares_micro_gemms", False):
        return

    def compile_with_shared_micro_gemms(cls, graph, wrapper_code, kernel_code, *args, **kwargs):
        return compile_library(cls, graph, wrapper_code, share_micro_gemms(kernel_code), *args, **kwargs)

    compile_with_shared_micro_gemms.shares_micro_gemms = True
    AotCodeCompiler.compile = classmethod(compile_with_shared_micro_gemms)
