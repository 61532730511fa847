"""The C++ GEMM template's fp32 micro-kernel as full compiles it on CPU: accumulators kept in registers, the
weights prefetched when it computes more than one row, and on AVX2 each weight vector loaded once per k-step.

- **Accumulators.** The kernel keeps its block of C in a `VectorizedN` of `Vectorized<float>`, and g++ 12 stores
  every accumulator to the stack after each of its FMAs, in every k-step. Held as the raw vector type
  (`__m512` / `__m256`), the same loop keeps them in registers. Compute-bound GEMMs (prefill) gain most.
- **Prefetch.** A decode step's GEMMs stream weights that do not fit in cache; over several rows the same loads
  with several times the FMAs between them keep fewer cache misses in flight. The packed weight block is
  prefetched PREFETCH_DISTANCE k-steps ahead, into L2, when the kernel computes more than one row; over one row it
  does not help, so that kernel does not prefetch. A prefetch never faults, so the one that reaches past the end
  of a block is harmless.
- **Weights in registers (AVX2).** g++ 12 folds each weight vector's load into every row's FMA, so a 4-row
  k-step makes 12 loads of 3 vectors; AVX2 has 16 vector registers and the 12 accumulators, the 3 weights and a
  broadcast row value just fit. An empty asm that takes each loaded vector as a register operand makes g++ keep
  it there (GNU inline asm, which g++ and clang take; other compilers keep the load as it is). AVX-512 has 32
  registers and is not measured, so it keeps the load as it is.
- **K in chunks over a few row blocks (AVX2).** Over more rows than its register block (4 on AVX2), the
  template's entry makes one pass per row block over each K-chunk of a weight panel: the later passes read what
  the first brought, and their prefetches reach only those lines, so memory idles while they run. The changed
  entry walks K in chunks of PREFETCH_DISTANCE k-steps for 5-16 rows, every row block over each chunk, so the
  first block's prefetches fetch the next chunk while the others compute on this one. The sums run in the same
  order, so results are bitwise the same. Wider passes are bound by their FMAs, so the split stops at
  SPLIT_MAX_ROW_BLOCKS. A k=4 step verifies 5 rows, a k=3 step at batch 2 8.

Measured in docs/cpu-performance.md, "GEMMs" (python -m compiled_spec.benchmarks.gemm_rows).

torch_patches.py installs the first three (the kernel) and the fourth (the entry) as two patches, each once per
process. A torch whose template reads otherwise keeps that part as it is: slower, as correct.
"""

from __future__ import annotations

import re

import torch._inductor.compile_fx  # noqa: F401  first: cpp_micro_gemm imported on its own is a circular import
from torch._inductor.codegen import cpp_micro_gemm

# k-steps ahead: 32 x 48 floats, 6 KB of the packed block; the distance is measured in docs/cpu-performance.md
# ("GEMMs").
PREFETCH_DISTANCE = 32
# Row blocks (block_m rows each) up to which the entry walks K in chunks: decode passes, bound by their bytes.
SPLIT_MAX_ROW_BLOCKS = 4

# The kernel's code for a B that is not transposed, where both changes go.
_PLAIN_B_START = "{%- if not trans_b %}\n    constexpr auto VLEN"
_PLAIN_B_END = "    // Use 2 implementations for the transposed B:"

_WEIGHT_LOAD = """        {%- else %}
            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);
        {%- endif %}
    {%- endif %}"""
_PREFETCHED_WEIGHT_LOAD = f"""        {{%- else %}}
            if constexpr (BLOCK_M > 1) {{
                _mm_prefetch(reinterpret_cast<const char*>(B + (k + {PREFETCH_DISTANCE}) * ldb + col * VLEN),
                             _MM_HINT_T1);
            }}
#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
            {{
                __m256 weights = Vectorized::loadu(B + k * ldb + col * VLEN);
                asm("" : "+x"(weights));  // held in a register: g++ would load it again in every row's FMA
                vb[col] = Vectorized(weights);
            }}
#else
            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);
#endif
        {{%- endif %}}
    {{%- endif %}}"""

_ACCUMULATORS = "    at::vec::VectorizedN<{{compute_t}}, ROWS*COLS> vc;\n"
_ACCUMULATORS_IN_REGISTERS = """#if defined(CPU_CAPABILITY_AVX512)
    __m512 vc[ROWS*COLS];
#elif defined(CPU_CAPABILITY_AVX2)
    __m256 vc[ROWS*COLS];
#else
    at::vec::VectorizedN<{{compute_t}}, ROWS*COLS> vc;
#endif
"""
# (as the kernel reads an accumulator, as it reads one held raw): the other uses convert on their own.
_ACCUMULATOR_READS = [
    ("vc[idx] = at::vec::fmadd(va, vb[col], vc[idx]);", "vc[idx] = at::vec::fmadd(va, vb[col], Vectorized(vc[idx]));"),
    ("vc[i].store(", "Vectorized(vc[i]).store("),
]

def changed_kernel(template: str) -> str | None:
    """The kernel template with the changes above, or None where it does not read as expected."""
    start, end = template.find(_PLAIN_B_START), template.find(_PLAIN_B_END)
    if start < 0 or end < 0:
        return None
    plain_b = template[start:end]
    if plain_b.count(_WEIGHT_LOAD) != 1 or plain_b.count(_ACCUMULATORS) != 1:
        return None
    plain_b = plain_b.replace(_WEIGHT_LOAD, _PREFETCHED_WEIGHT_LOAD).replace(_ACCUMULATORS, _ACCUMULATORS_IN_REGISTERS)
    for read, raw_read in _ACCUMULATOR_READS:
        if read not in plain_b:
            return None
        plain_b = plain_b.replace(read, raw_read)
    return template[:start] + plain_b + template[end:]


# The entry's loop over row blocks, which the K chunks wrap; its kernel calls take K and the row block's A and B.
_ROW_BLOCKS_LOOP = "    for (int64_t m = 0; m < M; m += {{block_m}}) {"
_CHUNKED_K = f"""#if defined(CPU_CAPABILITY_AVX2)
    const int64_t k_step = M > {{{{block_m}}}} && M <= {SPLIT_MAX_ROW_BLOCKS} * {{{{block_m}}}} ? {PREFETCH_DISTANCE} : K;
#else
    const int64_t k_step = K;
#endif
    for (int64_t k0 = 0; k0 < K; k0 += k_step) {{
    const int64_t k_size = std::min<int64_t>(k_step, K - k0);
"""


def chunked_entry(entry: str) -> str | None:
    """The entry template walking K in chunks, or None where it does not read as expected."""
    start, end = entry.find(_ROW_BLOCKS_LOOP), entry.rfind("}")
    if start < 0:
        return None
    loop = entry[start:end]
    shifted = [("A + m * lda,", "A + k0 + m * lda,"), ("B + n,", "B + k0 * ldb + n,"),
               ("B + n * ldb,", "B + n * ldb + k0,")]
    calls = loop.count("A + m * lda,")  # argument lists; the kernel's name above each may differ by trans_b
    if any(old not in loop for old, _ in shifted) or loop.count(", accum, prefetch>(") != loop.count("_kernel<"):
        return None
    for old, new in shifted:
        loop = loop.replace(old, new)
    loop, count = re.subn(r"^(\s+)K,$", r"\1k_size,", loop, flags=re.M)
    if count != calls:
        return None
    # A chunk after the first adds to what the chunks before it left in C.
    later = loop.replace(", accum, prefetch>(", ", true, prefetch>(")
    return (entry[:start] + _CHUNKED_K + "    if (k0 == 0) {\n" + loop + "    } else {\n" + later + "    }\n    }\n"
            + entry[end:])


TEMPLATE_KERNEL_AS_SHIPPED = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_KERNEL
TEMPLATE_ENTRY_AS_SHIPPED = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_ENTRY
