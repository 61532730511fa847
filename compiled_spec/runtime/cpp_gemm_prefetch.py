"""The C++ GEMM template's fp32 micro-kernel with a software prefetch of the weights when it computes more than one row.

A decode step's GEMMs stream weights that do not fit in cache. Over one row the template's micro-kernel did that at
27-30 GB/s here, but over 3 rows at 18 and over 4 at 15 (30 SmolLM2-sized MLPs, 319 MB, 2 threads): the same loads
with three times the FMAs between them keep fewer cache-line misses in flight. Prefetching the packed weight block
PREFETCH_DISTANCE k-steps ahead (into L2) brought 3 rows to 12.1-12.4 ms (26 GB/s) from 17.6, and 4 rows to 13.9 from
21.0, ahead of MKL's 14.8 and 18-20 (benchmarks/gemm_rows.py). Over one row it did not help, so it stays out of
that kernel. A prefetch never faults, so the one that reaches past the end of a block is harmless.
"""

from __future__ import annotations

import torch._inductor.compile_fx  # noqa: F401  first: cpp_micro_gemm imported on its own is a circular import
from torch._inductor.codegen import cpp_micro_gemm

# k-steps ahead: 32 x 48 floats, 6 KB of the packed block. 16 streamed 5% slower, 64 12% slower.
PREFETCH_DISTANCE = 32

_WEIGHT_LOAD = """        {%- else %}
            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);
        {%- endif %}
    {%- endif %}"""

_PREFETCHED_WEIGHT_LOAD = f"""        {{%- else %}}
            if constexpr (BLOCK_M > 1) {{
                _mm_prefetch(reinterpret_cast<const char*>(B + (k + {PREFETCH_DISTANCE}) * ldb + col * VLEN), _MM_HINT_T1);
            }}
            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);
        {{%- endif %}}
    {{%- endif %}}"""

# The micro-kernel as this torch ships it (benchmarks/gemm_rows.py compares it).
TEMPLATE_KERNEL_WITHOUT_PREFETCH = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_KERNEL.replace(
    _PREFETCHED_WEIGHT_LOAD, _WEIGHT_LOAD)

# What packages' and inductor's cache keys take, so that code compiled without the prefetch is not reused for it.
CACHE_KEY = f"prefetch {PREFETCH_DISTANCE} k-steps ahead into L2 over more than one row"


def prefetch_weights_over_several_rows() -> bool:
    """Makes the fp32 micro-kernel prefetch as above, once per process. False when this torch's template does not
    load its weights as expected (then the kernel stays as it is: slower over several rows, as correct)."""
    kernel = cpp_micro_gemm.CppMicroGemmFP32Vec
    if _PREFETCHED_WEIGHT_LOAD in kernel.TEMPLATE_KERNEL:
        return True
    if kernel.TEMPLATE_KERNEL.count(_WEIGHT_LOAD) != 1:
        return False
    kernel.TEMPLATE_KERNEL = kernel.TEMPLATE_KERNEL.replace(_WEIGHT_LOAD, _PREFETCHED_WEIGHT_LOAD)
    return True
