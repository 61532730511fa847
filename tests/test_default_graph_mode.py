import subprocess
import sys

import pytest

from compiled_spec import LLM, CompiledSpecError, GraphMode
from compiled_spec.config import GRAPH_MODE_VARIABLE


def test_full_is_the_default_and_on_cpu_it_starts_tiered(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv(GRAPH_MODE_VARIABLE)  # the suite's conftest makes eager the default for the other tests
    # On CUDA: the fastest mode a GPU run has shown equal to eager (compile; full has not shown replay parity yet).
    assert GraphMode.default_for("cuda") == GraphMode.COMPILE
    assert GraphMode.default_for("cpu") == GraphMode.FULL
    path = tiny_checkpoint("predictive").path
    llm = LLM(path, max_seq_len=32, warm_up=False)
    assert llm.config.graph_mode == GraphMode.FULL
    assert llm.engine.startup.options.tiered_start and llm.engine.startup.options.spec is not None  # warm-up would compile in the background
    given = LLM(path, max_seq_len=32, graph_mode="full", warm_up=False)
    assert not given.engine.startup.options.tiered_start  # a graph mode given: warm-up waits for its compile
    assert given.engine.startup.options.spec is not None  # (which runs in child processes where that is quicker)


def test_the_environment_names_another_default(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv(GRAPH_MODE_VARIABLE, "compile")
    assert GraphMode.default_for("cpu") == GraphMode.COMPILE
    monkeypatch.setenv(GRAPH_MODE_VARIABLE, "eager")
    llm = LLM(tiny_checkpoint("predictive").path, max_seq_len=32)
    assert llm.config.graph_mode == GraphMode.EAGER and not llm.engine.startup.options.tiered_start and llm.engine.startup.options.spec is None
    monkeypatch.setenv(GRAPH_MODE_VARIABLE, "fast")
    with pytest.raises(CompiledSpecError, match="COMPILED_SPEC_GRAPH_MODE='fast' is not a graph mode; choose one "
                                                "of: eager, compile"):
        GraphMode.default_for("cpu")


def test_a_background_compile_needs_full_on_cpu(tiny_checkpoint):
    with pytest.raises(CompiledSpecError, match="background_compile=True needs graph_mode='full' on CPU, not 'eager'"):
        LLM(tiny_checkpoint("predictive").path, max_seq_len=32, graph_mode="eager", background_compile=True)


def test_a_bad_count_of_compile_processes_is_named(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("predictive").path
    with pytest.raises(CompiledSpecError, match="compile_workers=0 is not allowed; choose 1 or more processes"):
        LLM(path, max_seq_len=32, graph_mode="full", compile_workers=0, warm_up=False)
    monkeypatch.setenv("COMPILED_SPEC_COMPILE_WORKERS", "two")
    with pytest.raises(CompiledSpecError, match="COMPILED_SPEC_COMPILE_WORKERS='two' is not a whole number"):
        LLM(path, max_seq_len=32, graph_mode="full", warm_up=False)


def test_the_compile_child_starts_its_workers_before_importing_torch():
    """The compile child (`python -m compiled_spec.engine.compile_worker`) imports nothing heavy before it starts its
    worker processes, which import torch at the same time; the public names still load on first use."""
    code = ("import sys, compiled_spec.engine.compile_worker\n"
            "print(sorted(m for m in ('torch', 'transformers', 'compiled_spec.api') if m in sys.modules))\n"
            "from compiled_spec import LLM, SamplingParams\n"
            "print(LLM.__module__, SamplingParams.__module__, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "compiled_spec.api compiled_spec.params True"]
    import compiled_spec

    with pytest.raises(AttributeError, match="module 'compiled_spec' has no attribute 'Engine'"):
        compiled_spec.Engine
