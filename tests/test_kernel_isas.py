"""The CPU kernels compile for every x86 vector ISA inductor picks (AVX2, AVX-512, AVX-512 with AMX), whatever ISA
this machine has: compile only (-fsyntax-only), with the flags the real build uses, so a machine of one ISA catches a
build break on the others."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from torch._inductor import cpu_vec_isa
from torch.utils import cpp_extension

from compiled_spec.model import cpu_kernels


class NoVectorISA:
    """A CPU without AVX2 (another architecture): the sources compile their ATen fallbacks."""

    def build_arch_flags(self) -> str:
        return ""

    def build_macro(self) -> list[str]:
        return []


def compile_with(isa, source, *mode: str) -> subprocess.CompletedProcess:
    """The compiler run over one kernel source with `isa`'s build flags and the extension's includes; `mode`: what
    it makes (-fsyntax-only, or -E -dM for the macros defined)."""
    compiler = shutil.which("c++")
    assert compiler, "a C++ compiler is needed to build the CPU kernels"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = [compiler, *mode, "-std=c++20", "-fPIC", *cpu_kernels.build_flags(isa()),
               *(f"-I{path}" for path in includes), "-DTORCH_EXTENSION_NAME=isa_check",
               "-DTORCH_API_INCLUDE_EXTENSION_H", str(source)]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.parametrize("isa", [cpu_vec_isa.VecAVX2, cpu_vec_isa.VecAVX512, cpu_vec_isa.VecAMX, NoVectorISA],
                         ids=lambda isa: isa.__name__)
def test_the_cpu_kernels_compile_with_each_isas_flags(isa):
    for source in cpu_kernels.SOURCES:
        result = compile_with(isa, source, "-fsyntax-only")
        assert result.returncode == 0, f"{source.name} with {isa.__name__}'s flags:\n{result.stderr[-3000:]}"


# The macro each source defines when its vectorized kernel is compiled in (else it falls back to ATen).
VECTOR_KERNELS = {"half_weight_linear.cpp": "HALF_WEIGHT_KERNEL", "packed_linear.cpp": "PACKED_KERNEL"}


@pytest.mark.parametrize("isa", [cpu_vec_isa.VecAVX2, cpu_vec_isa.VecAVX512, cpu_vec_isa.VecAMX],
                         ids=lambda isa: isa.__name__)
def test_each_isas_flags_compile_the_vectorized_kernels_not_their_fallbacks(isa):
    for source in cpu_kernels.SOURCES:
        if source.name not in VECTOR_KERNELS:
            continue
        result = compile_with(isa, source, "-E", "-dM")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"#define {VECTOR_KERNELS[source.name]} 1" in result.stdout, (
            f"{source.name} with {isa.__name__}'s flags compiles only its ATen fallback")


def test_the_extension_name_holds_no_spaces_whatever_the_isa():
    for isa in (cpu_vec_isa.VecAVX2(), cpu_vec_isa.VecAVX512(), cpu_vec_isa.VecAMX()):
        name = cpu_kernels._isa_name(isa)
        assert name.replace("_", "").isalnum(), (str(isa), name)
    assert cpu_kernels._isa_name(cpu_vec_isa.VecAMX()) == "avx512_avx512_vnni_amx_tile"


BROKEN_BUILD = """
import sys
from pathlib import Path
from compiled_spec.model import cpu_kernels
cpu_kernels.SOURCES = [Path(sys.argv[1])]
assert not cpu_kernels.load()
print(cpu_kernels.status())
"""


def test_a_failed_kernel_build_is_remembered_and_not_retried_until_the_sources_change(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("int broken( {\n")
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}

    def build() -> str:
        result = subprocess.run([sys.executable, "-c", BROKEN_BUILD, str(source)], capture_output=True, text=True,
                                env=environment, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    first = build()
    assert first.startswith("not built: ") and "broken.cpp:1" in first and "error:" in first and "earlier build" not in first
    assert "could not build the CPU kernels" in subprocess.run(
        [sys.executable, "-W", "always", "-c", BROKEN_BUILD, str(source)], capture_output=True, text=True,
        env=environment).stderr  # the user is told, on stderr
    second = build()
    assert "an earlier build" in second and first.removeprefix("not built: ") in second  # ninja never ran again
    source.write_text("int broken( { /* edited */\n")
    assert "earlier build" not in build()  # new sources: a new try
