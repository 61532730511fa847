"""compiled-spec changes torch only where it compiles: importing it, or decoding in eager, leaves torch as it ships;
the first compiled runner installs every patch (compiler/torch_patches.py). Each in a fresh process: this one may have
installed them already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What each patch replaces, read in a form a later read can be compared with (a function by its id).
SNAPSHOT = """
import json, logging, sys
import torch
import torch._inductor.compile_fx
from torch._inductor.codecache import AotCodeCompiler
from torch._inductor.codegen import cpp_micro_gemm, cpp_template_kernel
from torch._inductor.codegen.common import KernelTemplate
from torch._inductor.cpp_builder import CppBuilder

def snapshot():
    gemm = cpp_micro_gemm.CppMicroGemmFP32Vec
    return {
        "KernelTemplate._template_from_string": id(KernelTemplate.__dict__["_template_from_string"].__func__),
        "cpp_template_kernel.parse_expr_with_index_symbols": id(cpp_template_kernel.parse_expr_with_index_symbols),
        "AotCodeCompiler.compile": id(AotCodeCompiler.__dict__["compile"].__func__),
        "CppBuilder.build": id(CppBuilder.build),
        "CppMicroGemmFP32Vec.TEMPLATE_KERNEL": gemm.TEMPLATE_KERNEL,
        "CppMicroGemmFP32Vec.TEMPLATE_ENTRY": gemm.TEMPLATE_ENTRY,
        "dynamo.recompile_limit": torch._dynamo.config.recompile_limit,
        "dynamo.accumulated_recompile_limit": torch._dynamo.config.accumulated_recompile_limit,
    }

def changed(before, after):
    return sorted(name for name in before if before[name] != after[name])
"""

EAGER_THEN_COMPILED = SNAPSHOT + """
shipped = snapshot()
import compiled_spec
from compiled_spec import LLM, SamplingParams
after_import = snapshot()
eager = LLM(graph_mode="eager", max_batch_size=1, max_seq_len=64)
eager.generate(["ROMEO:"], SamplingParams(max_tokens=4))
after_eager = snapshot()
LLM(graph_mode="compile", max_batch_size=1, max_seq_len=64, warm_up=False, show_progress=False)
after_compiled = snapshot()
print(json.dumps([changed(shipped, after_import), changed(shipped, after_eager), changed(shipped, after_compiled)]))
"""

# install() where torch does not read as a patch expects: that patch (only) stays as shipped and says so once.
INSTALL_ON_ANOTHER_TORCH = SNAPSHOT + """
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
from compiled_spec.compiler import torch_patches
case = sys.argv[1]
if case == "entry reads otherwise":
    cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_ENTRY = "an entry the chunks do not fit"
elif case == "another torch":
    torch.__version__ = "2.99.0"
shipped = snapshot()
torch_patches.install()
print(json.dumps([changed(shipped, snapshot()), torch_patches.installed(), torch_patches.cache_key()]))
"""

PATCHED = ["AotCodeCompiler.compile", "CppMicroGemmFP32Vec.TEMPLATE_ENTRY", "CppMicroGemmFP32Vec.TEMPLATE_KERNEL",
           "KernelTemplate._template_from_string", "cpp_template_kernel.parse_expr_with_index_symbols",
           "dynamo.accumulated_recompile_limit", "dynamo.recompile_limit"]


def run(script: str, *args: str) -> tuple[list[str], list]:
    """(log lines, the JSON the script prints last)."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    return [line for line in lines if line.startswith("LOG ")], json.loads(lines[-1])


def test_import_and_eager_leave_torch_as_shipped_and_a_compiled_runner_installs_every_patch():
    _, (after_import, after_eager, after_compiled) = run(EAGER_THEN_COMPILED)
    assert after_import == [] and after_eager == []
    # CppBuilder.build is replaced only while an AOTInductor library builds.
    assert after_compiled == PATCHED


@pytest.fixture(scope="module")
def installed_as_usual():
    return run(INSTALL_ON_ANOTHER_TORCH, "this torch")


def test_every_patch_fits_this_torch_and_keys_the_text_it_installed(installed_as_usual):
    logged, (changed, keys, cache_key) = installed_as_usual
    assert logged == [] and changed == PATCHED
    assert "as shipped" not in keys.values() and len(set(keys.values())) == len(keys)
    assert all(f"{name}: {key}" in cache_key for name, key in keys.items())


def test_a_patch_that_does_not_fit_leaves_its_part_as_shipped_logs_one_line_and_is_not_in_the_key(
        installed_as_usual):
    _, (_, usual_keys, usual_cache_key) = installed_as_usual
    entry = "fp32 micro-GEMM entry: K in chunks"
    logged, (changed, keys, cache_key) = run(INSTALL_ON_ANOTHER_TORCH, "entry reads otherwise")
    assert changed == [name for name in PATCHED if name != "CppMicroGemmFP32Vec.TEMPLATE_ENTRY"]
    assert len(logged) == 1 and entry in logged[0] and "left as torch ships it" in logged[0]
    assert keys[entry] == "as shipped" and cache_key != usual_cache_key
    assert {name: key for name, key in keys.items() if name != entry} == {
        name: key for name, key in usual_keys.items() if name != entry}


def test_on_a_torch_the_patches_were_not_written_for_torch_stays_as_shipped(installed_as_usual):
    logged, (changed, keys, _) = run(INSTALL_ON_ANOTHER_TORCH, "another torch")
    assert changed == [] and set(keys.values()) == {"as shipped"}
    assert len(logged) == len(keys) and all("2.99.0" in line for line in logged)
