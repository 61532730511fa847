"""Inductor's compile time: what cuts it without changing the compiled code's speed. Each piece here is a replacement
for one of inductor's functions; torch_patches.py installs them."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import sympy
import torch._inductor.compile_fx  # noqa: F401  first: inductor's codegen imported on its own is a circular import
from torch._inductor import cpp_builder, cpu_vec_isa
from torch._inductor.codecache import LOCK_TIMEOUT
from torch._inductor.cpp_builder import CppBuilder
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.utils._filelock import FileLock

def templates_parsed_once(template_from_string):
    """KernelTemplate._template_from_string, keeping each parsed template. Inductor parses the jinja source of a C++
    GEMM template's parts (ten sources) again for every GEMM it renders, and renders each GEMM twice, so a graph
    parses the same sources thousands of times. The parsed template depends on the source alone, so it is kept
    (docs/graph-modes.md, "What a graph's compile costs, and what was cut")."""
    return functools.cache(template_from_string)


def index_expressions_parsed_once(parse):
    """cpp_template_kernel.parse_expr_with_index_symbols, parsing each text once per process. A C++ template kernel
    parses its index expressions from text with sympy each time it renders: a graph makes thousands of such calls
    over a dozen distinct texts (docs/graph-modes.md, "What a graph's compile costs, and what was cut"). The parse
    depends on the text alone and sympy expressions are immutable."""
    parsed_text = functools.cache(parse)

    def parse_once(expr):
        if isinstance(expr, (sympy.Expr, list, tuple)):
            return parse(expr)  # an expression as it is; a sequence element by element, through parse_once
        return parsed_text(str(expr))

    return parse_once


_MICRO_GEMM = re.compile(r"inline void (\w+)_micro_gemm_kernel\(")


def share_micro_gemms(kernel_code: str) -> str:
    """An AOTInductor kernel source with one definition of each distinct micro-GEMM.

    Each C++ GEMM template kernel defines its own micro-GEMM templates, named after the kernel, and instantiates them
    for every row block up to its register blocking (16 unrolled vector kernels each). A graph's GEMMs differ in
    shape, not in their micro-GEMM: a step's GEMM kernels share a couple of distinct micro-GEMMs, each instantiated
    in every kernel, and g++ compiles each copy (docs/graph-modes.md, "What a graph's compile costs, and what was
    cut"). Each is named after its source here; the source is the same, so what is compiled from it is too. A
    micro-GEMM whose source names anything else of its kernel keeps its own definition."""
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


def micro_gemms_shared(compile_library):
    """AotCodeCompiler.compile (its function, under the classmethod) that gets its kernel source through
    share_micro_gemms."""

    def compile_with_shared_micro_gemms(cls, graph, wrapper_code, kernel_code, *args, **kwargs):
        return compile_library(cls, graph, wrapper_code, share_micro_gemms(kernel_code), *args, **kwargs)

    return compile_with_shared_micro_gemms


# The two object files of an AOTInductor library, built one after the other by AotCodeCompiler.compile.
_OBJECT_SOURCES = (".wrapper.cpp", ".kernel.cpp")
# Every wrapper source opens with the runtime interface, the same text in every graph.
_INTERFACE_START = "// Definition of AOTI runtime interface functions"
_INTERFACE_END = '\n} // extern "C"\n'
INTERFACE_FOLDER = "compiled_spec_runtime_interface"


def split_runtime_interface(wrapper_code: str) -> tuple[str, str] | None:
    """(interface, model) of an AOTInductor wrapper source: the runtime interface it opens with (the C functions
    the loader calls, over the model container) and the graph's own code, with the headers the interface part
    includes in front. None when the source does not open that way."""
    start = wrapper_code.find(_INTERFACE_START)
    end = wrapper_code.find(_INTERFACE_END, start)
    if start < 0 or end < 0:
        return None
    end += len(_INTERFACE_END)
    interface = wrapper_code[:end]
    includes = "".join(f"{line}\n" for line in interface.splitlines() if line.startswith("#include"))
    return interface, includes + wrapper_code[end:]


def _object_source(builder: CppBuilder) -> str | None:
    """The source of a builder that compiles the wrapper's or the kernels' object file, else None."""
    source = builder._sources_args
    if builder._compile_only and source.endswith(_OBJECT_SOURCES) and " " not in source and os.path.isfile(source):
        return source
    return None


def _build_from_snapshot(build, builder: CppBuilder, source: str) -> None:
    """Builds from a copy of the source: AotCodeCompiler appends the build commands to the source as comments
    while g++ may still be reading it."""
    snapshot = f"{source[:-len('.cpp')]}.snapshot.cpp"
    shutil.copyfile(source, snapshot)
    builder._sources_args = snapshot
    try:
        build(builder)
    finally:
        builder._sources_args = source
        os.remove(snapshot)


def _interface_object(interface: str, command: str, source: str, target: str) -> str:
    """The object file of the runtime interface, built with the wrapper's command line (which compiles `source` into
    `target`) once per cache folder and kept there: a compile process that finds it, or waits for another one
    building it, uses it as it is."""
    key = hashlib.sha256(f"{interface}\0{command.replace(source, '<source>').replace(target, '<object>')}"
                         .encode()).hexdigest()[:24]
    folder = os.path.join(cache_dir(), INTERFACE_FOLDER)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"interface-{key}.o")
    with FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT):
        if not os.path.exists(path):
            partial = os.path.join(folder, f"interface-{key}.{os.getpid()}")
            with open(f"{partial}.cpp", "w") as file:
                file.write(interface)
            try:
                command = command.replace(source, f"{partial}.cpp").replace(target, f"{partial}.o")
                cpp_builder.run_compile_cmd(command, cwd=folder)
                os.replace(f"{partial}.o", path)
            finally:
                os.remove(f"{partial}.cpp")
    return path


def objects_built_at_once(compile_library):
    """AotCodeCompiler.compile (its function, under the classmethod) that builds its object files at once and links
    when all are done, and builds the runtime interface (the opening quarter of each wrapper source, the same in every
    graph) once per cache folder instead of in every wrapper. It replaces CppBuilder.build while it runs.

    AotCodeCompiler builds the wrapper's and the kernels' objects one after the other, and every wrapper compiles the
    same runtime interface again. The objects compiled are the same code inductor would build, split in two files
    (docs/graph-modes.md, "What a graph's compile costs, and what was cut")."""
    build = CppBuilder.build
    pool = ThreadPoolExecutor(len(_OBJECT_SOURCES) + 1, thread_name_prefix="object-build")

    def compile_with_objects_at_once(cls, graph, wrapper_code, *args, **kwargs):
        owner = threading.get_ident()
        pending: list[Future] = []
        interface: Future | None = None  # the interface object's path
        # A C++-only package (for CMake) must hold the whole wrapper source.
        split = None if torch._inductor.config.aot_inductor.package_cpp_only else split_runtime_interface(wrapper_code)

        def build_at_once(builder):
            nonlocal interface
            if threading.get_ident() != owner:  # another thread's build (an ISA check): not this library's
                return build(builder)
            source = _object_source(builder)
            if source is None:  # the link, a header, the constants
                for job in pending:
                    job.result()  # the link reads every object file
                if interface is not None and ".wrapper.o" in builder._sources_args:
                    builder._sources_args += f" {interface.result()}"
                return build(builder)
            if split is not None and source.endswith(".wrapper.cpp"):
                interface = pool.submit(_interface_object, split[0], builder.get_command_line(), source,
                                        builder.get_target_file_path())
                pending.append(interface)
            pending.append(pool.submit(_build_from_snapshot, build, builder, source))

        CppBuilder.build = build_at_once
        try:
            library = compile_library(cls, graph, split[1] if split else wrapper_code, *args, **kwargs)
        finally:
            CppBuilder.build = build
            wait(pending)
        for job in pending:
            job.result()
        return library

    return compile_with_objects_at_once


_isa_probes: list[Future] | None = None


def probe_vector_isas_in_background() -> None:
    """Starts inductor's checks of which vector instruction sets g++ can build (AVX-512, AVX2, ...) at once, in
    threads, so that they run while the first graph is still being traced.

    Inductor makes them the first time it needs the vector ISA, one after the other: four g++ builds of its
    vector headers, once per cache folder. Compile processes that start together wait on one another's locks for
    them. Each check is cached by inductor, so the later lookups return its result."""
    global _isa_probes
    if _isa_probes is not None or platform.machine() not in ("x86_64", "AMD64"):
        return
    supported = cpu_vec_isa.x86_isa_checker()
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                  if all(flag in supported for flag in str(isa).split())]
    if not candidates:
        _isa_probes = []
        return
    probes = ThreadPoolExecutor(len(candidates), thread_name_prefix="isa-probe")
    _isa_probes = [probes.submit(bool, isa) for isa in candidates]
    probes.shutdown(wait=False)
