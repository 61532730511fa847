"""The C++ CPU kernels, built once per machine and then loaded: decode attention for compiled CPU decode passes
(decode_attention.cpp), the drafts' float16-weight linear (half_weight_linear.cpp) and the weight-only quantized
linear (packed_linear.cpp).

Decode attention reads only the cache positions a row may attend to, where SDPA and grouped_attention read the whole
cache (max_seq_len rows) and mask most of it away, and it shares each key and value row among the query heads of its
kv head. torch.ops.compiled_spec_cpu.decode_attention exists once load() has returned True.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch

from . import cpu_kernel_ops  # noqa: F401  the schemas of the ops the build registers

SOURCES = [Path(__file__).with_name("decode_attention.cpp"), Path(__file__).with_name("half_weight_linear.cpp"),
           Path(__file__).with_name("packed_linear.cpp")]
log = logging.getLogger(__name__)

_loaded = False
_failure: str | None = None  # why the kernels did not build here


def loaded() -> bool:
    """Whether the kernels are registered in this process (read while tracing: attention takes it only then)."""
    return _loaded


def status() -> str:
    """What a run records of the kernels: "built", "not built: <why>", or "not needed" (not loaded: eager, CUDA, or
    not built yet on this machine)."""
    if _loaded:
        return "built"
    return "not needed" if _failure is None else f"not built: {_failure}"


def _isa_name(isa) -> str:
    """The ISA as an extension name can hold it: torch names AVX-512 with AMX "avx512 avx512_vnni amx_tile", and
    spaces would split the compiler's command line."""
    return re.sub(r"[^A-Za-z0-9_]+", "_", str(isa)).strip("_") or "default"


def build_flags(isa) -> list[str]:
    """The compiler flags for `isa` (an inductor VecISA): its architecture flags and CPU_CAPABILITY macro, and F16C
    with AVX-512 (every AVX-512 CPU has it, but inductor's AVX-512 flags leave it out, and without it the float16
    draft kernel is not compiled: the drafts' matrices were widened at every call)."""
    arch = isa.build_arch_flags().split()
    if "-mavx512f" in arch and "-mf16c" not in arch:
        arch.append("-mf16c")
    return ["-O3", "-DNDEBUG", "-fopenmp", *arch, *(f"-D{m}" for m in isa.build_macro())]


def library_name() -> str:
    """The build's name: this CPU's vector capability, and a digest of torch's version and the sources, so that a
    library on disk under this name is this build and loads without asking inductor for the ISA or ninja whether it
    is current (each takes seconds)."""
    digest = hashlib.sha256("\0".join([torch.__version__, *(s.read_text() for s in SOURCES)]).encode())
    return f"compiled_spec_cpu_kernels_{_isa_name(torch.backends.cpu.get_cpu_capability()).lower()}_{digest.hexdigest()[:12]}"


def _build_directory(name: str) -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, False))


def _failure_marker(name: str) -> Path:
    """Where a failed build of this name (these sources, this torch, this CPU) is remembered, so later processes do
    not retry it (a compile error costs seconds of both cores each time)."""
    return _build_directory(name) / "failed.txt"


def _built_library(name: str) -> Path | None:
    """The built library, where a whole one is on disk (cpp_extension holds its lock file while it builds)."""
    folder = _build_directory(name)
    library = folder / f"{name}.so"
    return library if library.exists() and not (folder / "lock").exists() else None


def load_if_built() -> bool:
    """Registers the kernels where they are already built on this machine (milliseconds); never builds them. Eager
    passes call this: they decode with the ATen fallbacks until a compile (the background compile of a tiered start,
    say) has built the kernels, and later processes load them."""
    global _loaded
    if not _loaded and (library := _built_library(library_name())) is not None:
        torch.ops.load_library(str(library))
        _loaded = True
    return _loaded


def expected() -> bool:
    """Whether load() will register the kernels here, answered without building them: they are built, or no build
    of these sources has failed on this machine and a compiler and ninja are there. Compiled packages are named by
    it, so a process can find its packages before the kernels are built (compiler/aot_packages.py)."""
    from torch.utils import cpp_extension

    if _loaded or _failure is not None:
        return _loaded
    name = library_name()
    if _built_library(name) is not None:
        return True
    return (not _failure_marker(name).exists() and cpp_extension.is_ninja_available()
            and shutil.which(os.environ.get("CXX", "c++")) is not None)


@functools.cache
def load() -> bool:
    """Builds the kernels for this CPU's vector ISA (the first time on a machine, seconds: docs/cpu-performance.md;
    later processes load the built library) and registers them. Where they cannot be built, warns once and returns
    False: compiled CPU passes then attend with grouped_attention and SDPA, and float16 draft weights are widened
    to the activations' dtype in the graph."""
    global _loaded, _failure
    if load_if_built():
        return True
    from torch._inductor import cpu_vec_isa
    from torch.utils import cpp_extension

    name = library_name()
    start = time.perf_counter()
    try:
        marker = _failure_marker(name)
        if marker.exists():
            raise RuntimeError(f"{marker.read_text().strip()} (an earlier build; remove {marker} to try again)")
        try:
            cpp_extension.load(name=name, sources=[str(source) for source in SOURCES],
                               extra_cflags=build_flags(cpu_vec_isa.pick_vec_isa()), extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
        except Exception as error:
            if cpp_extension.is_ninja_available() and shutil.which(os.environ.get("CXX", "c++")):
                marker.write_text(_first_error(str(error)))  # a compile error, not a missing tool: remember it
            raise
    except Exception as error:  # a machine without a C++ compiler or ninja still decodes, only slower
        _failure = _first_error(str(error))
        warnings.warn(f"compiled-spec: could not build the CPU kernels ({_failure}); compiled CPU passes "
                      "attend with grouped_attention and SDPA instead", stacklevel=2)
        return False
    log.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
    _loaded = True
    return True


def _first_error(text: str) -> str:
    """The compiler's first error line, where the text has one (a build log runs to hundreds of lines)."""
    lines = text.strip().splitlines()
    errors = [line.strip() for line in lines if "error:" in line]
    return (errors[0] if errors else lines[0] if lines else "unknown error")[:300]
