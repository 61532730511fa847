"""full against eager on one workload: acceptance parity, zero recompiles, one package for every batch and every prompt
width, packages a later engine loads, weights kept outside the packages. compile and piecewise (and full on more
architectures, dtypes and weights) are compared with eager in test_parity_matrix.py.

The workload has more requests than slots, of mixed prompt lengths, so requests are admitted while
others decode and batches are padded to buckets. Prompts longer than the one prefill bucket (16) prefill
in eager at their own length, in every mode, and the compiled steps continue from the state they leave.
The MTP modules mimic the main model, so steps accept none, some and all of their drafts.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir

from compiled_spec import LLM, SamplingParams
from compiled_spec.compiler import weight_store
from compiled_spec.compiler.step_runner import PACKAGED_PREFILL_MIN_WIDTH, StepRunner, graphs_made
from compiled_spec.config import GraphMode
from compiled_spec.compiler.aot_packages import PACKAGE_FOLDER

K = 2
# Every test here shares the compiled engines; test_tiered_start[dense] loads the full packages after them.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("full_engine_packages")]

ENGINE = dict(num_speculative_tokens=K, max_batch_size=4, max_seq_len=64, batch_buckets=(2, 4), prefill_buckets=(16,))
PROMPT_LENGTHS = [3, 17, 5, 9, 30, 1, 12, 7, 22, 4, 15, 2, 26, 8, 11, 6, 19, 13]


@pytest.fixture(scope="session")
def workload(tiny_checkpoint):
    checkpoint = tiny_checkpoint("predictive")
    vocab = checkpoint.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    return checkpoint.path, prompts


def run_workload(llm: LLM, prompts):
    llm.engine.step_log.clear()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    return [o.token_ids for o in outputs], list(llm.engine.step_log)


@pytest.fixture(scope="session")
def eager_result(workload):
    path, prompts = workload
    return run_workload(LLM(path, graph_mode="eager", **ENGINE), prompts)


@pytest.fixture(scope="session", params=["full"])
def compiled_result(request, workload):
    path, prompts = workload
    graphs_before = counters["stats"]["unique_graphs"]
    packages_before = set(os.listdir(folder)) if (folder := Path(cache_dir()) / PACKAGE_FOLDER).is_dir() else set()
    llm = LLM(path, graph_mode=request.param, show_progress=False, compile_workers=2, **ENGINE)
    graphs_after_warm_up = graphs_made(llm.engine.runner)
    if request.param == "full":  # two or more packages missing: two child processes compiled them, this one loaded
        compiled, loaded = llm.engine.runner.packages()
        missing = sorted(set(compiled + loaded) - packages_before)
        if len(missing) >= 2:
            assert compiled == [] and sorted(llm.engine.startup.compiled_in_processes) == missing
            assert llm.engine.startup.compile_processes == 2
        else:
            assert sorted(compiled) == missing
    with torch.compiler.set_stance("fail_on_recompile"):
        result = run_workload(llm, prompts)
        eager_prefills = llm.engine.eager_prefills
        again = run_workload(llm, prompts)
    return dict(
        eager_prefills=eager_prefills,
        mode=request.param,
        llm=llm,
        result=result,
        again=again,
        warm_up_graphs=graphs_after_warm_up - graphs_before,
        workload_graphs=graphs_made(llm.engine.runner) - graphs_after_warm_up,
    )


def test_acceptance_and_outputs_equal_eager(eager_result, compiled_result):
    eager_tokens, eager_steps = eager_result
    tokens, steps = compiled_result["result"]
    accepted = [count for step in eager_steps for _, count in step]
    # The workload must exercise rejection, partial and full acceptance, or parity would prove little.
    assert {0, 1, K} <= set(accepted), sorted(set(accepted))
    assert tokens == eager_tokens
    assert steps == eager_steps
    longer = sum(n > ENGINE["prefill_buckets"][-1] for n in PROMPT_LENGTHS)
    assert compiled_result["eager_prefills"] == longer > 0


# full on CPU: one step package for batches 1 to 4 and one prefill package for every prompt width up to 16.
FULL_PACKAGES = 2


def test_zero_recompiles_after_warm_up(compiled_result):
    # Every graph made during warm-up.
    assert compiled_result["warm_up_graphs"] == FULL_PACKAGES
    assert compiled_result["workload_graphs"] == 0
    assert compiled_result["again"] == compiled_result["result"]


def test_full_mode_on_cpu_folds_the_weights_into_its_gemms(compiled_result):
    """Freezing must really freeze: with the weights as graph inputs every matmul stays an aten::mm call (what
    `full` did when Dynamo lifted them as inputs), with them folded max-autotune compiles C++ GEMM kernels."""
    engine = compiled_result["llm"].engine
    eager = StepRunner(engine.model, engine.state, engine.constants, GraphMode.EAGER, engine.runner.step_drafts)

    def matmuls(runner) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            runner.step(ENGINE["batch_buckets"][0], engine.step_drafts()[0])
        calls = {event.key: event.count for event in profiler.key_averages()}
        return sum(calls.get(name, 0) for name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear"))

    assert matmuls(engine.runner) == 0
    assert matmuls(eager) > 0  # the same step in eager: the check can see matmuls


def rerun_recording(compiled_result, prompts, method: str) -> list[tuple[tuple, int]]:
    """Runs the workload again (it must decode as before, under fail_on_recompile) and returns, for each call of the
    runner's `method`, its arguments and how many requests were admitted then."""
    engine = compiled_result["llm"].engine
    calls = []
    original = getattr(engine.runner, method)

    def recorded(*args):
        calls.append((args, len(engine.slots)))
        return original(*args)

    setattr(engine.runner, method, recorded)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            assert run_workload(compiled_result["llm"], prompts) == compiled_result["result"]
    finally:
        delattr(engine.runner, method)
    return calls


@pytest.mark.parametrize("compiled_result", ["full"], indirect=True)
def test_full_on_cpu_prefills_each_prompt_at_its_own_width_with_one_package(workload, eager_result, compiled_result):
    """full on CPU compiles one prefill package for every prompt width from PACKAGED_PREFILL_MIN_WIDTH (10) up to the
    largest prefill bucket: a prompt is padded only to 10 (attention takes another path at 9 rows or fewer), not to
    a bucket."""
    path, prompts = workload
    engine = compiled_result["llm"].engine
    assert PACKAGED_PREFILL_MIN_WIDTH == 10
    assert engine.runner.prefill_widths == (10, ENGINE["prefill_buckets"][-1])
    packages = engine.runner.packages()
    widths = [args[1].shape[1] for args, _ in rerun_recording(compiled_result, prompts, "prefill")]
    short = [n for n in PROMPT_LENGTHS if n <= ENGINE["prefill_buckets"][-1]]
    assert sorted(widths) == sorted(max(n, 10) for n in short)
    assert len(set(widths)) > 3
    assert engine.runner.packages() == packages  # no package compiled or loaded for any of those widths


@pytest.mark.parametrize("compiled_result", ["full"], indirect=True)
def test_full_on_cpu_steps_each_batch_at_its_own_size_with_one_package(workload, compiled_result):
    """full on CPU compiles one step package for every batch up to the largest bucket: a step over 3 requests runs 3
    lanes, not the 4 of its bucket, and a step over a single request runs 1, not the 2 of its bucket."""
    path, prompts = workload
    engine = compiled_result["llm"].engine
    assert engine.runner.step_batches == (1, ENGINE["batch_buckets"][-1])
    packages = engine.runner.packages()
    sizes = [(args[0], requests) for args, requests in rerun_recording(compiled_result, prompts, "step")]
    assert {batch for batch, _ in sizes} == {1, 2, 3, 4}
    assert all(batch == requests for batch, requests in sizes)
    assert engine.runner.packages() == packages  # no package compiled or loaded for any of those batches


@pytest.mark.parametrize("compiled_result", ["full"], indirect=True)
def test_a_second_full_engine_on_cpu_loads_every_bucket_instead_of_compiling(workload, compiled_result):
    """full on CPU keeps each bucket as an AOTInductor package; an engine of the same model and configuration
    (here in the same process, normally a later one) loads every bucket and decodes the same."""
    path, prompts = workload
    compiled, loaded = compiled_result["llm"].engine.runner.packages()
    assert len(compiled + loaded) == FULL_PACKAGES
    llm = LLM(path, graph_mode="full", show_progress=False, **ENGINE)
    again_compiled, again_loaded = llm.engine.runner.packages()
    assert again_compiled == [] and sorted(again_loaded) == sorted(compiled + loaded)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert run_workload(llm, prompts) == compiled_result["result"]
    # No second copy of the frozen weights: a constant that is one of the engine's weights is bound to that weight's
    # own memory; the constants the compile made (pre-packed GEMM weights) are one tensor for both.
    first_llm = compiled_result["llm"]
    first, second = first_llm.engine.runner.bound_constants(), llm.engine.runner.bound_constants()
    assert first and first.keys() == second.keys()
    def weights(engine):  # the model's weights and the step's constant tensors (rope tables, EOS ids)
        tensors = [*engine.model.state_dict().values(), *engine.constants._asdict().values()]
        return {weight_store.digest(t): t for t in tensors if isinstance(t, torch.Tensor)}

    own = [(engine_llm, bound, weights(engine_llm.engine)) for engine_llm, bound in ((first_llm, first), (llm, second))]
    for engine_llm, bound, weights in own:
        assert bound.keys() & weights.keys(), "no constant is one of the model's weights"
        for key in bound.keys() & weights.keys():
            assert bound[key].data_ptr() == weights[key].data_ptr(), key
    made = first.keys() - own[0][2].keys()
    assert made and all(first[key] is second[key] for key in made)


@pytest.mark.parametrize("compiled_result", ["full"], indirect=True)
def test_full_packages_on_cpu_keep_their_weights_outside_and_share_them(compiled_result):
    """A package holds the compiled code and a map from its constants (the frozen, pre-packed weights) to
    digests; each constant is stored once beside the packages, so buckets with equal constants share them."""
    runner = compiled_result["llm"].engine.runner
    compiled, loaded = runner.packages()
    folder = Path(cache_dir()) / PACKAGE_FOLDER
    manifests = []
    for name in compiled + loaded:
        with zipfile.ZipFile(folder / name) as archive:
            assert not [entry for entry in archive.namelist() if "/weights/" in entry or entry.endswith(".cpp")]
            library = archive.read(next(entry for entry in archive.namelist() if entry.endswith(".so")))
            if shutil.which("strip"):
                assert b".symtab" not in library  # stripped: the section's name goes with it
        manifests.append(weight_store.read_manifest(folder / name))
    digests = [key for manifest in manifests for key in manifest.values()]
    assert set(digests) == runner.bound_constants().keys()
    for index, manifest in enumerate(manifests):  # each bucket shares constants with another bucket
        others = {key for other in manifests[:index] + manifests[index + 1:] for key in other.values()}
        assert set(manifest.values()) & others, compiled + loaded
    for key, tensor in runner.bound_constants().items():
        assert weight_store.digest(torch.load(folder / "constants" / f"{key}.pt")) == key
        assert weight_store.digest(tensor) == key
