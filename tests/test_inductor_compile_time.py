"""What cuts inductor's compile time must leave the compiled code as it was."""

from __future__ import annotations

import re

import sympy
import torch
from torch._inductor.codegen.common import KernelTemplate

from compiled_spec.config import GraphMode
from compiled_spec.runtime import inductor_compile_time
from compiled_spec.runtime.graph_modes import inductor_options, spec_backend
from compiled_spec.runtime.inductor_compile_time import REALIZE_OPCOUNT_THRESHOLD
from compiled_spec.speculative import rng
from passes import SpecPassManager
from passes.manager import PassContext


def test_a_kernel_template_source_is_parsed_once_and_renders_as_before():
    source = "{{ name }}({{ args | join(', ') }})"
    parsed = KernelTemplate._template_from_string(source)
    assert KernelTemplate._template_from_string(source) is parsed
    assert parsed.render(name="gemm", args=["X", "W"]) == "gemm(X, W)"
    assert parsed.render(name="mm", args=["A"]) == "mm(A)"


def test_a_template_index_expression_is_parsed_once_into_integer_symbols(monkeypatch):
    template_kernel = inductor_compile_time.cpp_template_kernel
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


def test_gemm_kernels_of_one_graph_share_each_micro_gemm_and_compute_as_eager(monkeypatch, tmp_path):
    sources = []  # (kernel source as inductor wrote it, as compiled)
    share = inductor_compile_time.share_micro_gemms

    def recorded(kernel_code):
        sources.append((kernel_code, share(kernel_code)))
        return sources[-1][1]

    monkeypatch.setattr(inductor_compile_time, "share_micro_gemms", recorded)
    torch.manual_seed(0)
    # Three GEMMs of three shapes over 4 rows: the C++ GEMM template renders each as its own kernel. Two of them
    # block their output columns alike (with AVX-512 and with AVX2).
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False),
                              torch.nn.Linear(128, 384, bias=False)).eval()
    rows = torch.randn(4, 128)
    with torch.no_grad():
        exported = torch.export.export(mlp, (rows,))
        package = torch._inductor.aoti_compile_and_package(
            exported, package_path=str(tmp_path / "mlp.pt2"),
            inductor_configs=inductor_options(GraphMode.FULL, torch.device("cpu")))
        compiled = torch._inductor.aoti_load_package(package)(rows)
        expected = mlp(rows)

    (original, shared), = sources
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
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)
