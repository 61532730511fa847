"""What cuts inductor's compile time must leave the compiled code as it was."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
import zipfile
from types import SimpleNamespace

import pytest
import sympy
import torch
import torch._inductor.compile_fx  # noqa: F401  first: cpp_template_kernel imported on its own is a circular import
from torch._inductor import cpp_builder, cpu_vec_isa
from torch._inductor.codegen import cpp_template_kernel
from torch._inductor.codegen.common import KernelTemplate

from compiled_spec.config import GraphMode
from compiled_spec.compiler import inductor_compile_time, torch_patches
from compiled_spec.compiler.step_runner import REALIZE_OPCOUNT_THRESHOLD, inductor_options, spec_backend
from compiled_spec.compiler.micro_gemm_kernel import PREFETCH_DISTANCE, TEMPLATE_ENTRY_AS_SHIPPED, cpp_micro_gemm
from compiled_spec.speculative import rng
from compiled_spec.passes import SpecPassManager
from compiled_spec.passes.manager import PassContext


@pytest.fixture(autouse=True, scope="module")
def patched_torch():
    """The changes these tests check are installed with the first compiled runner; here without one."""
    torch_patches.install()


def test_a_kernel_template_source_is_parsed_once_and_renders_as_before():
    source = "{{ name }}({{ args | join(', ') }})"
    parsed = KernelTemplate._template_from_string(source)
    assert KernelTemplate._template_from_string(source) is parsed
    assert parsed.render(name="gemm", args=["X", "W"]) == "gemm(X, W)"
    assert parsed.render(name="mm", args=["A"]) == "mm(A)"


def test_a_template_index_expression_is_parsed_once_into_integer_symbols(monkeypatch):
    template_kernel = cpp_template_kernel
    parsed, parse_expr = [], template_kernel.parse_expr
    monkeypatch.setattr(template_kernel, "parse_expr", lambda text: parsed.append(text) or parse_expr(text))
    text = "256*row_of_this_test + column_of_this_test"
    first = template_kernel.parse_expr_with_index_symbols([text, 7])
    again = template_kernel.parse_expr_with_index_symbols((text, 7))
    assert parsed.count(text) == 1
    row, column = (sympy.Symbol(name, integer=True, nonnegative=True) for name in ("row_of_this_test",
                                                                                     "column_of_this_test"))
    assert first == again == [256 * row + column, 7]
    expression = sympy.Symbol("x") + 1
    assert template_kernel.parse_expr_with_index_symbols(expression) is expression


def test_the_sampler_hash_compiled_with_early_realization_equals_eager():
    options = inductor_options(GraphMode.COMPILE, torch.device("cpu"))
    assert options["realize_opcount_threshold"] == REALIZE_OPCOUNT_THRESHOLD

    def draw(seeds, positions):
        return rng.uniforms(rng.stream_key(seeds[:, None], positions, rng.DRAFT + 1), 4096)

    manager = SpecPassManager([], PassContext(graph_name="draw", state_writes=(), options=options))
    compiled = torch.compile(draw, fullgraph=True, dynamic=False, backend=spec_backend(options, manager))
    seeds = torch.tensor([0, 2**40 + 7, 2**63 - 1])
    positions = torch.arange(12).view(3, 4)
    assert torch.equal(compiled(seeds, positions), draw(seeds, positions))


@pytest.fixture(scope="module")
def compiled_mlp(tmp_path_factory):
    """Three GEMMs of three shapes over 4 rows, compiled by AOTInductor with full's options (the C++ GEMM template
    renders each as its own kernel; two of them block their output columns alike, with AVX-512 and with AVX2), and
    what the compile did: the kernel source as inductor wrote it and as compiled, and each g++ run (start, end,
    command line)."""
    sources, runs = [], []
    share, run_compile_cmd = inductor_compile_time.share_micro_gemms, cpp_builder.run_compile_cmd

    def recorded(kernel_code):
        sources.append((kernel_code, share(kernel_code)))
        return sources[-1][1]

    def timed(cmd_line, cwd):
        start = time.monotonic()
        try:
            return run_compile_cmd(cmd_line, cwd)
        finally:
            runs.append((start, time.monotonic(), cmd_line))

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False),
                              torch.nn.Linear(128, 384, bias=False)).eval()
    rows = torch.randn(4, 128)
    folder = tmp_path_factory.mktemp("mlp")
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(inductor_compile_time, "share_micro_gemms", recorded)
        patch.setattr(cpp_builder, "run_compile_cmd", timed)
        exported = torch.export.export(mlp, (rows,))
        package = torch._inductor.aoti_compile_and_package(
            exported, package_path=str(folder / "mlp.pt2"),
            inductor_configs=inductor_options(GraphMode.FULL, torch.device("cpu")))
        compiled = torch._inductor.aoti_load_package(package)(rows)
        expected = mlp(rows)
    return SimpleNamespace(sources=sources, runs=runs, compiled=compiled, expected=expected, package=package)


def test_gemm_kernels_of_one_graph_share_each_micro_gemm_and_compute_as_eager(compiled_mlp):
    (original, shared), = compiled_mlp.sources
    micro_gemm_definition = re.compile(r"inline void (\w+)_micro_gemm_kernel\(")
    kernels_before = micro_gemm_definition.findall(original)
    kernels_after = micro_gemm_definition.findall(shared)
    blockings = set(re.findall(r"constexpr int64_t Mr = (\d+);\s*constexpr int64_t Nr = (\d+);\s*"
                               r"constexpr int64_t Kr = (\d+);", original))
    assert len(kernels_before) == 3
    assert len(kernels_after) == len(blockings) < len(kernels_before)
    assert all(kernel.startswith("shared_") for kernel in kernels_after)
    assert not any(f"{kernel}_micro_gemm" in shared for kernel in kernels_before)
    # Each GEMM kernel calls a shared definition (twice: the first K block, then accumulating).
    assert sum(shared.count(f"{kernel}_micro_gemm<") for kernel in kernels_after) == 2 * len(kernels_before)
    torch.testing.assert_close(compiled_mlp.compiled, compiled_mlp.expected, rtol=1e-5, atol=1e-5)


def test_the_micro_gemm_holds_its_accumulators_raw_prefetches_over_several_rows_and_computes_as_eager(compiled_mlp):
    """Not a compile-time change, but the same compiled GEMMs show it (micro_gemm_kernel): each micro-kernel keeps its
    accumulators as the raw vector type, which g++ holds in registers, and prefetches the packed weights
    PREFETCH_DISTANCE k-steps ahead when it computes more than one row."""
    (_, shared), = compiled_mlp.sources
    kernels = re.findall(r"inline void \w+_micro_gemm_kernel\(.*?\n}\n", shared, flags=re.S)
    assert kernels
    prefetch = (f"if constexpr (BLOCK_M > 1) {{\n"
                f"                _mm_prefetch(reinterpret_cast<const char*>(B + (k + {PREFETCH_DISTANCE}) * ldb")
    raw_accumulators = ("#if defined(CPU_CAPABILITY_AVX512)\n    __m512 vc[ROWS*COLS];\n"
                        "#elif defined(CPU_CAPABILITY_AVX2)\n    __m256 vc[ROWS*COLS];")
    weights_in_registers = ("#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)\n            {\n"
                            "                __m256 weights = Vectorized::loadu(B + k * ldb + col * VLEN);\n"
                            "                asm(\"\" : \"+x\"(weights));")
    assert all(prefetch in kernel and raw_accumulators in kernel for kernel in kernels)
    assert all(weights_in_registers in kernel for kernel in kernels)
    assert all("vc[idx] = at::vec::fmadd(va, vb[col], Vectorized(vc[idx]));" in kernel for kernel in kernels)
    torch.testing.assert_close(compiled_mlp.compiled, compiled_mlp.expected, rtol=1e-5, atol=1e-5)


def test_over_a_few_row_blocks_the_micro_gemm_walks_k_in_chunks_and_sums_as_before(tmp_path):
    """micro_gemm_kernel's entry: over 2-4 register blocks of rows (9 rows are 3 blocks of 4 on AVX2) each GEMM walks K
    in chunks of PREFETCH_DISTANCE k-steps, every row block over each chunk. Its sums run in the order they did, so
    the output is bitwise that of the entry as torch ships it (on AVX-512 the chunks are compiled out)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 96, bias=False)).eval()
    rows = torch.randn(9, 128)
    # The FX graph cache does not tell the two entries apart.
    options = {**inductor_options(GraphMode.FULL, torch.device("cpu")), "force_disable_caches": True}
    entry = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_ENTRY
    share = inductor_compile_time.share_micro_gemms
    sources, outputs = {"chunked": "", "as shipped": ""}, {}

    def recorded(code, name):
        shared = share(code)
        sources[name] += shared
        return shared

    with torch.no_grad():
        exported = torch.export.export(mlp, (rows,))
        for name, template in (("chunked", entry), ("as shipped", TEMPLATE_ENTRY_AS_SHIPPED)):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(cpp_micro_gemm.CppMicroGemmFP32Vec, "TEMPLATE_ENTRY", template)
                patch.setattr(inductor_compile_time, "share_micro_gemms", lambda code, name=name: recorded(code, name))
                package = torch._inductor.aoti_compile_and_package(
                    exported, package_path=str(tmp_path / f"{len(outputs)}.pt2"), inductor_configs=options)
            outputs[name] = torch._inductor.aoti_load_package(package)(rows)
        expected = mlp(rows)
    chunks = (f"    const int64_t k_step = M > 4 && M <= 4 * 4 ? {PREFETCH_DISTANCE} : K;" if
              isinstance(cpu_vec_isa.pick_vec_isa(), cpu_vec_isa.VecAVX2) else f"? {PREFETCH_DISTANCE} : K;")
    assert chunks in sources["chunked"] and "for (int64_t k0 = 0; k0 < K; k0 += k_step)" in sources["chunked"]
    assert "k_step" not in sources["as shipped"]
    assert torch.equal(outputs["chunked"], outputs["as shipped"])
    torch.testing.assert_close(outputs["chunked"], expected, rtol=1e-5, atol=1e-5)


def test_on_avx2_every_fma_of_the_compiled_gemms_takes_its_weights_from_a_register(compiled_mlp, tmp_path):
    """The machine code, not the source: g++ folded each weight vector's load into every row's FMA (12 loads per
    4-row k-step instead of 3) until the micro-kernel held the loaded vector in a register (micro_gemm_kernel)."""
    if not isinstance(cpu_vec_isa.pick_vec_isa(), cpu_vec_isa.VecAVX2):
        pytest.skip("the weights are held in registers on AVX2 only; inductor compiles for another vector ISA here")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    with zipfile.ZipFile(compiled_mlp.package) as archive:
        library, = (name for name in archive.namelist() if name.endswith(".so"))
        archive.extract(library, tmp_path)
    code = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(tmp_path / library)], capture_output=True,
                          text=True, check=True).stdout
    fma_operands = re.findall(r"\tvfmadd\w+ps\s+(\S+)", code)
    assert len(fma_operands) >= 12  # one 4-row, 24-column k-step at least
    assert [operand for operand in fma_operands if "(" in operand] == []


def test_the_objects_build_at_once_the_runtime_interface_apart_and_the_link_waits_for_them(compiled_mlp):
    def run(pattern):
        found = [(start, end, cmd) for start, end, cmd in compiled_mlp.runs if re.search(pattern, cmd)]
        assert len(found) == 1, (pattern, [cmd[:120] for _, _, cmd in compiled_mlp.runs])
        return found[0]

    wrapper = run(r"\.wrapper\.snapshot\.cpp ")
    kernel = run(r"\.kernel\.snapshot\.cpp ")
    link = run(r"\.wrapper\.o .*\.kernel\.o ")
    assert max(wrapper[0], kernel[0]) < min(wrapper[1], kernel[1])  # both g++ runs were under way together
    assert link[0] >= max(wrapper[1], kernel[1])
    # Each built from a copy of its source, since removed; the sources themselves stay as inductor wrote them,
    # less the runtime interface, which is linked from its own object file, built once per cache folder.
    interface = next(word for word in link[2].split() if "/interface-" in word)
    assert os.path.dirname(interface).endswith(inductor_compile_time.INTERFACE_FOLDER) and os.path.isfile(interface)
    for _, _, cmd in (wrapper, kernel):
        snapshot = next(word for word in cmd.split() if word.endswith(".snapshot.cpp"))
        assert not os.path.exists(snapshot)
        with open(snapshot.replace(".snapshot.cpp", ".cpp")) as source:
            assert "AOTInductorModelContainerRun(" not in source.read()
    torch.testing.assert_close(compiled_mlp.compiled, compiled_mlp.expected, rtol=1e-5, atol=1e-5)


def test_a_wrapper_source_splits_into_its_runtime_interface_and_the_graphs_own_code():
    wrapper = ('\n#include <torch/csrc/inductor/aoti_include/cpu.h>\n'
               '// Definition of AOTI runtime interface functions\n'
               '\n#include <torch/csrc/inductor/aoti_runtime/interface.h>\nextern "C" {\nint f() { return 1; }\n'
               '} // extern "C"\n\nnamespace torch::aot_inductor {\nvoid g() {}\n}\n')
    interface, model = inductor_compile_time.split_runtime_interface(wrapper)
    assert interface.endswith('} // extern "C"\n') and "int f()" in interface and "void g()" not in interface
    assert model == ("#include <torch/csrc/inductor/aoti_include/cpu.h>\n"
                     "#include <torch/csrc/inductor/aoti_runtime/interface.h>\n"
                     "\nnamespace torch::aot_inductor {\nvoid g() {}\n}\n")
    assert inductor_compile_time.split_runtime_interface("void g() {}\n") is None


def forget_vector_isa_checks() -> None:
    """Drops the results of inductor's vector ISA checks kept in this process (not the files they built)."""
    for cls in {cpu_vec_isa.VecISA, *(type(isa) for isa in cpu_vec_isa.supported_vec_isa_list)}:
        for name in ("__bool__", "_VecISA__bool__impl"):
            kept = cls.__dict__.get(name)
            if hasattr(kept, "cache_clear"):
                kept.cache_clear()
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_vector_isa_checks_run_at_once_in_the_background_and_leave_inductors_choice_as_it_was(monkeypatch, tmp_path):
    supported = cpu_vec_isa.x86_isa_checker()
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                  if all(flag in supported for flag in str(isa).split())]
    if len(candidates) < 2:
        pytest.skip("this CPU has fewer than two vector ISAs for inductor to check")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no check has been built here
    monkeypatch.setattr(inductor_compile_time, "_isa_probes", None)
    forget_vector_isa_checks()
    builds = []  # (thread, start, end) of each g++ run
    run_compile_cmd = cpp_builder.run_compile_cmd

    def timed(cmd_line, cwd):
        start = time.monotonic()
        try:
            return run_compile_cmd(cmd_line, cwd)
        finally:
            builds.append((threading.current_thread().name, start, time.monotonic()))

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", timed)
    inductor_compile_time.probe_vector_isas_in_background()
    results = [probe.result(timeout=300) for probe in inductor_compile_time._isa_probes]
    assert len(results) == len(candidates) and results[-1]  # the last candidate, AVX2 at least, builds here
    first_build = {}
    for thread, start, end in builds:
        first_build.setdefault(thread, (start, end))
    assert len(first_build) == len(candidates)  # each check in a thread of its own
    assert max(start for start, _ in first_build.values()) < min(end for _, end in first_build.values())
    # Checked again one after the other, as inductor does (reusing the files built), each gives the same answer,
    # and inductor's list of usable ISAs is made of them.
    forget_vector_isa_checks()
    assert [bool(isa) for isa in candidates] == results
    assert cpu_vec_isa.valid_vec_isa_list() == [isa for isa, ok in zip(candidates, results) if ok]
