"""The C++ attention kernel of compiled CPU decode passes (decode_attention.cpp): built once per machine, then loaded.
The same build holds the drafts' float16-weight linear (half_weight_linear.cpp) and the weight-only quantized linear
(packed_linear.cpp).

It reads only the cache positions a row may attend to, where SDPA and grouped_attention read the whole cache
(max_seq_len rows) and mask most of it away, and it shares each key and value row among the query heads of its
kv head. torch.ops.compiled_spec_cpu.decode_attention exists once load() has returned True.
"""

from __future__ import annotations

import functools
import logging
import re
import time
import warnings
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_suffix(".cpp"), Path(__file__).with_name("half_weight_linear.cpp"),
           Path(__file__).with_name("packed_linear.cpp")]
log = logging.getLogger(__name__)

_loaded = False
_tried = False


def loaded() -> bool:
    """Whether the kernels are registered in this process (read while tracing: attention takes it only then)."""
    return _loaded


def expected() -> bool:
    """Whether graphs compiled in this process attend with the kernel: load()'s result once it has run. Before that
    (a tiered start names its packages before it builds the kernel), whether it can be built: ninja runs."""
    return _loaded if _tried else _ninja_runs()


@functools.cache
def _ninja_runs() -> bool:
    from torch.utils import cpp_extension

    return cpp_extension.is_ninja_available()


def _isa_name(isa) -> str:
    """The ISA as an extension name can hold it: torch names AVX-512 with AMX "avx512 avx512_vnni amx_tile", and
    spaces would split the compiler's command line."""
    return re.sub(r"[^A-Za-z0-9_]+", "_", str(isa)).strip("_") or "default"


@functools.cache
def load() -> bool:
    """Builds the kernels for this CPU's vector ISA (the first time on a machine, in about 16 s on a 2-core VM;
    later processes load the built library) and registers them. Where they cannot be built, warns once and returns
    False: compiled CPU passes then attend with grouped_attention and SDPA, and float16 draft weights are widened
    to the activations' dtype in the graph."""
    global _loaded, _tried
    from torch._inductor import cpu_vec_isa
    from torch.utils import cpp_extension

    from . import half_weight_linear, packed_linear  # noqa: F401  define the ops the build registers

    isa = cpu_vec_isa.pick_vec_isa()
    flags = ["-O3", "-DNDEBUG", "-fopenmp", *isa.build_arch_flags().split()]
    flags += [f"-D{macro}" for macro in isa.build_macro()]
    start = time.perf_counter()
    _tried = True
    try:
        cpp_extension.load(
            name=f"compiled_spec_cpu_kernels_{_isa_name(isa)}", sources=[str(source) for source in SOURCES],
            extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )
    except Exception as error:  # a machine without a C++ compiler or ninja still decodes, only slower
        warnings.warn(f"compiled-spec: could not build the CPU kernels ({error}); compiled CPU passes "
                      "attend with grouped_attention and SDPA instead", stacklevel=2)
        return False
    log.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
    _loaded = True
    return True


torch.library.define(
    "compiled_spec_cpu::decode_attention", "(Tensor q, Tensor keys, Tensor values, Tensor attend) -> Tensor"
)


@torch.library.register_fake("compiled_spec_cpu::decode_attention")
def _(q, keys, values, attend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
