"""Every change compiled-spec makes to torch, in one place. install() makes them when the first compiled runner (or
compile backend) is built: importing compiled_spec, or decoding in eager, leaves torch as it ships. Two more last
only as long as one compile (context managers at the end of this file): partitions at the partition ops alone
(piecewise on CPU, cpu_partitions.py), and a look at each AOTInductor library's constants (weight_store.py).

- Dynamo's recompile limits, raised: every bucket of every engine in a process is a specialization of the same
  step and prefill functions.
- Inductor's compile time (inductor_compile_time.py): parsed kernel templates and index expressions kept, one
  definition of each micro-GEMM per kernel source, the object files of an AOTInductor library built at once.
- The C++ GEMM template's fp32 micro-kernel and its entry, as full compiles them on CPU (micro_gemm_kernel.py).

Each patch names the torch versions it was written for and checks that torch still reads as it expects. Where it
does not (another version, a private name moved, a template's text changed), the patch leaves torch as it is and
logs one line: compiles are slower, or GEMMs as torch ships them, and what is computed is the same. cache_key() says
which patches are in place, from the text each installed, so that compiled code is not reused across them.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import threading
import types
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

# The torch releases the patches were written for: [first, first not supported), as pyproject's torch pin.
TORCH_VERSIONS = ((2, 13), (2, 16))


class Unfit(Exception):
    """torch does not read as a patch expects; the message says what differs."""


@dataclass(frozen=True)
class Patch:
    name: str
    # Installs the patch and returns the text it installed (what its cache key is made of). Where torch reads
    # otherwise it raises Unfit (or an ImportError) and leaves torch as it was.
    apply: Callable[[], str]
    torch_versions: tuple[tuple[int, int], tuple[int, int]] = TORCH_VERSIONS


def _expect(owner, name: str, kind: type, parameters: list[str]) -> None:
    """Raises Unfit unless owner.name is a `kind` (staticmethod, classmethod, function) whose first parameters are
    `parameters`: what a patch's replacement calls it with."""
    value = inspect.getattr_static(owner, name, None)
    function = getattr(value, "__func__", value)
    if not isinstance(value, kind) or not callable(function):
        raise Unfit(f"{name} is not a {kind.__name__}")
    found = list(inspect.signature(function).parameters)[:len(parameters)]
    if found != parameters:
        raise Unfit(f"{name} takes ({', '.join(found)}), not ({', '.join(parameters)})")


def _source(*functions) -> str:
    return "".join(inspect.getsource(function) for function in functions)


def raise_recompile_limits() -> str:
    dynamo = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if not isinstance(getattr(dynamo, name, None), int):
            raise Unfit(f"torch._dynamo.config has no integer {name}")
    dynamo.recompile_limit = max(dynamo.recompile_limit, 512)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4096)
    return _source(raise_recompile_limits)


def keep_parsed_kernel_templates() -> str:
    from torch._inductor.codegen.common import KernelTemplate

    from .inductor_compile_time import templates_parsed_once

    _expect(KernelTemplate, "_template_from_string", staticmethod, ["source"])
    KernelTemplate._template_from_string = staticmethod(templates_parsed_once(KernelTemplate._template_from_string))
    return _source(keep_parsed_kernel_templates, templates_parsed_once)


def keep_parsed_index_expressions() -> str:
    import torch._inductor.compile_fx  # noqa: F401  first: cpp_template_kernel imported on its own is a circular import
    from torch._inductor.codegen import cpp_template_kernel

    from .inductor_compile_time import index_expressions_parsed_once

    _expect(cpp_template_kernel, "parse_expr_with_index_symbols", types.FunctionType, ["expr"])
    parse = cpp_template_kernel.parse_expr_with_index_symbols
    cpp_template_kernel.parse_expr_with_index_symbols = index_expressions_parsed_once(parse)
    return _source(keep_parsed_index_expressions, index_expressions_parsed_once)


_AOT_COMPILE_PARAMETERS = ["cls", "graph", "wrapper_code", "kernel_code"]


def share_micro_gemms() -> str:
    from torch._inductor.codecache import AotCodeCompiler

    from . import inductor_compile_time as compile_time

    _expect(AotCodeCompiler, "compile", classmethod, _AOT_COMPILE_PARAMETERS)
    AotCodeCompiler.compile = classmethod(compile_time.micro_gemms_shared(AotCodeCompiler.compile.__func__))
    return _source(share_micro_gemms, compile_time.micro_gemms_shared, compile_time.share_micro_gemms)


def build_objects_at_once() -> str:
    from torch._inductor.codecache import AotCodeCompiler
    from torch._inductor.cpp_builder import CppBuilder

    from . import inductor_compile_time as compile_time

    _expect(AotCodeCompiler, "compile", classmethod, _AOT_COMPILE_PARAMETERS)
    _expect(CppBuilder, "build", types.FunctionType, ["self"])
    for method in ("get_command_line", "get_target_file_path"):
        if not callable(getattr(CppBuilder, method, None)):
            raise Unfit(f"CppBuilder has no {method}")
    AotCodeCompiler.compile = classmethod(compile_time.objects_built_at_once(AotCodeCompiler.compile.__func__))
    return _source(build_objects_at_once, compile_time.objects_built_at_once, compile_time.split_runtime_interface,
                   compile_time._object_source, compile_time._build_from_snapshot, compile_time._interface_object)


def change_micro_kernel() -> str:
    from . import micro_gemm_kernel

    gemm = micro_gemm_kernel.cpp_micro_gemm.CppMicroGemmFP32Vec
    changed = micro_gemm_kernel.changed_kernel(gemm.TEMPLATE_KERNEL)
    if changed is None:
        raise Unfit("CppMicroGemmFP32Vec.TEMPLATE_KERNEL does not read as micro_gemm_kernel expects")
    gemm.TEMPLATE_KERNEL = changed
    return changed


def chunk_micro_gemm_entry() -> str:
    from . import micro_gemm_kernel

    gemm = micro_gemm_kernel.cpp_micro_gemm.CppMicroGemmFP32Vec
    if gemm.TEMPLATE_KERNEL == micro_gemm_kernel.TEMPLATE_KERNEL_AS_SHIPPED:
        raise Unfit("the micro-kernel is as shipped, without the prefetches the chunks are for")
    changed = micro_gemm_kernel.chunked_entry(gemm.TEMPLATE_ENTRY)
    if changed is None:
        raise Unfit("CppMicroGemmFP32Vec.TEMPLATE_ENTRY does not read as micro_gemm_kernel expects")
    gemm.TEMPLATE_ENTRY = changed
    return changed


PATCHES = (
    Patch("dynamo recompile limits raised", raise_recompile_limits),
    Patch("parsed kernel templates kept", keep_parsed_kernel_templates),
    Patch("parsed index expressions kept", keep_parsed_index_expressions),
    Patch("one definition of each micro-GEMM", share_micro_gemms),
    Patch("object files built at once", build_objects_at_once),
    Patch("fp32 micro-kernel: registers and prefetch", change_micro_kernel),
    Patch("fp32 micro-GEMM entry: K in chunks", chunk_micro_gemm_entry),
)

AS_SHIPPED = "as shipped"
_keys: dict[str, str] | None = None  # patch name -> its key, once install() has run


def install() -> None:
    """Makes every patch that fits this torch, once per process."""
    global _keys
    if _keys is not None:
        return
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    keys = {}
    for patch in PATCHES:
        low, high = patch.torch_versions
        try:
            if not low <= version < high:
                raise Unfit(f"written for torch >={low[0]}.{low[1]},<{high[0]}.{high[1]}, not {torch.__version__}")
            keys[patch.name] = hashlib.sha256(patch.apply().encode()).hexdigest()[:16]
        except (Unfit, ImportError, AttributeError) as reason:  # AttributeError: a private name moved
            log.warning("compiled-spec: %s: left as torch ships it (%s)", patch.name, reason)
            keys[patch.name] = AS_SHIPPED
    _keys = keys


def installed() -> dict[str, str]:
    """name -> key of each patch: a digest of the text it installed, or AS_SHIPPED. Empty before install()."""
    return dict(_keys or {})


def cache_key() -> str:
    """What compiled code depends on among the patches (install() first)."""
    if _keys is None:
        raise RuntimeError("torch_patches.install() has not run")
    return "; ".join(f"{name}: {key}" for name, key in sorted(_keys.items()))


# The changes below last as long as one compile; a lock keeps two threads from nesting them out of order.
_scoped = threading.RLock()


@contextlib.contextmanager
def partitions_where(should_partition: Callable, wrap_partition: Callable):
    """Inside: inductor's Scheduler.should_partition(scheduler, node) is should_partition(original, scheduler, node),
    and each partition function is wrapped by wrap_partition(function, metadata) (torch's partition-wrapper hook)."""
    from torch._inductor import scheduler, utils

    _expect(scheduler.Scheduler, "should_partition", types.FunctionType, ["self", "node"])
    with _scoped:
        original = scheduler.Scheduler.should_partition
        previous_wrapper = utils._unstable_customized_partition_wrapper.wrapper
        scheduler.Scheduler.should_partition = lambda self, node: should_partition(original, self, node)
        utils.set_customized_partition_wrappers(wrap_partition)
        try:
            yield
        finally:
            scheduler.Scheduler.should_partition = original
            utils.set_customized_partition_wrappers(previous_wrapper)


@contextlib.contextmanager
def before_each_aot_library(see_graph: Callable):
    """Inside: see_graph(graph) runs before each AOTInductor shared library is compiled, with the lowered graph
    (its constants among what it holds)."""
    from torch._inductor.codecache import AotCodeCompiler

    _expect(AotCodeCompiler, "compile", classmethod, ["cls", "graph"])  # maybe wrapped by the patches above
    with _scoped:
        compile_library = AotCodeCompiler.compile.__func__

        def compile_seen(cls, graph, *args, **kwargs):
            see_graph(graph)
            return compile_library(cls, graph, *args, **kwargs)

        AotCodeCompiler.compile = classmethod(compile_seen)
        try:
            yield
        finally:
            AotCodeCompiler.compile = classmethod(compile_library)
