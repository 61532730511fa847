"""The key of an ahead-of-time package (full on CPU): a package has no guards, so whatever its code depends on
must change the key, and nothing else may."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from compiled_spec import LLM
from compiled_spec.config import GraphMode
from compiled_spec.compiler import torch_patches
from compiled_spec.compiler.step_runner import inductor_options
from compiled_spec.compiler.aot_packages import (DynamicSize, code_digest, graph_code_files, model_digest, package_key,
                                           static_bucket)
from compiled_spec.speculative.step import prefill, speculative_step

ENGINE = dict(num_speculative_tokens=2, max_batch_size=4, max_seq_len=32, warm_up=False)
OPTIONS = inductor_options(GraphMode.FULL, torch.device("cpu"))


def key(llm: LLM, function=speculative_step, args=(2,), options=OPTIONS, passes="passes-uuid", bucket=None) -> str:
    engine = llm.engine
    bucket = static_bucket(args) if bucket is None else bucket
    return package_key(function, passes, options, model_digest(llm.model, engine.constants), engine.state, args, bucket)


def test_the_same_model_and_configuration_give_the_same_key(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    assert key(LLM(path, **ENGINE)) == key(LLM(path, **ENGINE))


def test_the_key_changes_with_what_the_compiled_code_depends_on(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    llm = LLM(path, **ENGINE)
    base = key(llm)
    assert key(llm, args=(4,)) != base  # another batch bucket
    assert key(llm, function=prefill) != base
    assert key(llm, passes="other-passes-uuid") != base
    assert key(llm, options={**OPTIONS, "max_autotune": False}) != base
    assert key(LLM(path, **{**ENGINE, "max_seq_len": 48})) != base  # the state's layout
    assert key(LLM(path, **{**ENGINE, "num_speculative_tokens": 1})) != base
    assert key(LLM(tiny_checkpoint("llama_mtp_indexed").path, **ENGINE)) != base  # another model
    weight = llm.model.embed_tokens.weight.view(-1)
    with torch.no_grad():
        weight[7] = torch.nextafter(weight[7], torch.tensor(float("inf")))  # the last bit of one weight
    assert key(llm) != base


ROOT = Path(__file__).resolve().parents[1]


def test_the_code_in_the_key_is_what_shapes_graphs_not_the_programs_around_them():
    hashed = {path.relative_to(ROOT).as_posix() for path in graph_code_files()}
    assert {"compiled_spec/model/layers.py", "compiled_spec/model/decode_attention.cpp",
            "compiled_spec/speculative/step.py", "compiled_spec/speculative/state.py", "compiled_spec/hisparse/fused.py", "compiled_spec/passes/state_mutation.py",
            "compiled_spec/compiler/step_runner.py", "compiled_spec/compiler/torch_patches.py",
            "compiled_spec/compiler/micro_gemm_kernel.py", "compiled_spec/config.py"} <= hashed
    outside = ("compiled_spec/server/", "compiled_spec/training/", "compiled_spec/benchmarks/", "compiled_spec/cli.py", "compiled_spec/api.py",
               "compiled_spec/engine/engine.py", "compiled_spec/engine/compile_worker.py")
    assert [path for path in hashed if path.startswith(outside)] == []


def test_the_code_key_keeps_when_a_server_or_training_file_changes_and_changes_with_a_model_file(tmp_path):
    """On a copy of the sources, so that no real file is edited."""
    for folder in ("compiled_spec",):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=lambda _, names: [
            name for name in names if "." in name and not name.endswith((".py", ".cpp"))])
    base = code_digest(tmp_path)

    def edited(path: str) -> str:
        with open(tmp_path / path, "a") as source:
            source.write("\n# edited\n")
        code_digest.cache_clear()
        return code_digest(tmp_path)

    assert edited("compiled_spec/server/app.py") == base
    assert edited("compiled_spec/training/train_mtp.py") == base
    assert edited("compiled_spec/api.py") == base
    assert edited("compiled_spec/model/layers.py") != base
    code_digest.cache_clear()


def test_one_prefill_package_covers_every_prompt_width_in_its_range(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("predictive").path, **ENGINE)
    widths = DynamicSize(arg=1, dim=1, low=4, high=16)

    def prefill_args(width: int) -> tuple:
        slot, prompt_len = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
        return slot, torch.zeros(1, width, dtype=torch.int64), prompt_len

    def prefill_key(width: int, dynamic: DynamicSize) -> str:
        args = prefill_args(width)
        return key(llm, function=prefill, args=args, bucket=dynamic.bucket(args))

    assert widths.bucket(prefill_args(5)) == widths.bucket(prefill_args(16)) == ((1,), (1, "4to16"), (1,))
    assert prefill_key(5, widths) == prefill_key(16, widths)
    assert prefill_key(16, widths) != prefill_key(16, DynamicSize(arg=1, dim=1, low=4, high=32))
    assert prefill_key(16, widths) != key(llm, function=prefill, args=prefill_args(16))  # a bucket of width 16 alone


def test_a_size_outside_the_range_gets_a_package_of_its_own_size():
    """A call outside a DynamicSize's range (here batches 2 to 8) gets a static package of its own size."""
    batches = DynamicSize(arg=0, dim=0, low=2, high=8)
    lanes = {size: (torch.zeros(size, dtype=torch.int64),) for size in (1, 2, 5, 8, 9)}
    assert batches.bucket(lanes[2]) == batches.bucket(lanes[5]) == batches.bucket(lanes[8]) == (("2to8",),)
    assert [batches.covers(lanes[size]) for size in (1, 2, 8, 9)] == [False, True, True, False]
    assert batches.bucket(lanes[1]) == static_bucket(lanes[1]) == ((1,),)
    assert batches.bucket(lanes[9]) == ((9,),)


def test_full_on_cpu_keeps_a_static_step_package_per_batch_bucket_below_a_largest_batch_of_3(tiny_checkpoint):
    """One step package takes every batch from 1 up when the largest batch bucket is 3 or more; below, each batch
    bucket keeps a static package (a range of two sizes does not pay for the dynamic batch's longer compile)."""
    path = tiny_checkpoint("predictive").path

    def steps(buckets):
        llm = LLM(path, graph_mode="full", max_batch_size=buckets[-1], batch_buckets=buckets, max_seq_len=32,
                  warm_up=False, show_progress=False)
        graphs = [(kind, size, "K" if drafts.k == llm.engine.max_drafts else drafts.k)
                  for kind, size, drafts in llm.engine.startup.warm_up_graphs() if kind == "step"]
        return llm.engine.runner.step_batches, graphs

    assert steps((1, 2)) == (None, [("step", 2, "K"), ("step", 1, "K")])
    assert steps((1, 2, 3)) == ((1, 3), [("step", 3, "K")])
    assert steps((4,)) == ((1, 4), [("step", 4, "K")])


def test_engines_that_draft_and_that_do_not_get_the_cpp_template_and_its_changed_kernel_is_in_their_keys(
        tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    full = dict(ENGINE, graph_mode="full")
    drafting, plain = LLM(path, **full).engine.runner, LLM(path, **{**full, "num_speculative_tokens": 0}).engine.runner
    for runner in (drafting, plain):
        for function in (*runner._steps.values(), *runner._prefills.values()):
            assert function.options["max_autotune_gemm_backends"] == "CPP" and function.options["freezing"]
            assert "cpp.weight_prepack" not in function.options
            # A package or FX graph compiled from the micro-kernel as torch ships it is not reused for the changed one.
            assert function.manager.context.options["torch_patches"] == torch_patches.cache_key()
    assert torch_patches.installed()["fp32 micro-kernel: registers and prefetch"] != torch_patches.AS_SHIPPED


# Names the step package a fresh process's engine expects before it builds the attention kernel (as a tiered start
# does), builds it, and names it again.
NAME_THE_STEP_PACKAGE = """
import json, sys, warnings
from compiled_spec import LLM
from compiled_spec.model import cpu_kernels
llm = LLM(sys.argv[1], graph_mode="full", max_batch_size=1, max_seq_len=32, warm_up=False, show_progress=False)
graph = next(graph for graph in llm.engine.startup.warm_up_graphs() if graph[0] == "step")
before = llm.engine.runner.package_path(*graph)
with warnings.catch_warnings(record=True):
    built = cpu_kernels.load()
print(json.dumps([built, str(before), str(llm.engine.runner.package_path(*graph))]))
"""


def test_a_package_compiled_with_the_attention_kernel_is_not_the_one_a_process_without_it_loads(tiny_checkpoint,
                                                                                                  tmp_path):
    """A package compiled where the kernel built calls it, and a package has no guards: a process where the kernel
    does not build (here, ninja fails) must name another package. Before the build, a process names the package it
    will use after, so a tiered start compiles the package it then loads."""
    path = str(tiny_checkpoint("predictive").path)
    failing = tmp_path / "bin"
    failing.mkdir()
    (failing / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (failing / "ninja").chmod(0o755)

    def name_the_step_package(path_prefix: list[str], extensions: dict) -> list:
        environment = {**os.environ, "PATH": os.pathsep.join([*path_prefix, os.environ["PATH"]]), **extensions}
        done = subprocess.run([sys.executable, "-c", NAME_THE_STEP_PACKAGE, path], env=environment,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    with_kernel = name_the_step_package([], {})
    # A machine where the kernels were never built (a library built earlier loads without ninja).
    without_kernel = name_the_step_package([str(failing)], {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")})
    assert with_kernel[0] and not without_kernel[0]
    assert with_kernel[1] == with_kernel[2] and without_kernel[1] == without_kernel[2]
    assert with_kernel[2] != without_kernel[2]
