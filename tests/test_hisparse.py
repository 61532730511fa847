"""HiSparse: tiered KV cache (cold pool, LRU hot buffer), sparse attention, the fusion pass, the draft-layer mirror.

Eager tests check the pieces; compiled tests are few and small (one tiny model, one bucket each).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from compiled_spec import LLM, CompiledSpecError, GraphMode, HiSparseConfig, SamplingParams
from compiled_spec.hisparse.fused import hisparse_attention
from compiled_spec.hisparse.indexer import KeyScorer, LightningIndexer
from compiled_spec.hisparse.reference import NEVER_EVICT, gather_selected, place_new_rows, sparse_attention, swap_in
from compiled_spec.compiler.step_runner import StepRunner, spec_backend
from faults import prefilling_in_eager, without_draft_mirror
from compiled_spec.passes import SpecPassManager
from compiled_spec.passes.hisparse_fusion import HiSparseFusionPass
from compiled_spec.passes.manager import PassContext
from test_audit import audit_failure

PROMPT_LENGTHS = (3, 17, 5, 9, 30, 1, 12)
SATURATED = HiSparseConfig(top_k_tokens=4, hot_rows=8)  # k=2: passes write up to 4 rows and read 4 per query
MIRROR_ENGINE = dict(num_speculative_tokens=2, max_batch_size=4, max_seq_len=64, batch_buckets=(4,), prefill_buckets=(64,))
DENSE_ENGINE = dict(num_speculative_tokens=1, max_batch_size=2, max_seq_len=32, batch_buckets=(2,), prefill_buckets=(32,))


def prompts_for(lengths, vocab=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in lengths]


def run(llm: LLM, prompts, max_tokens=20):
    llm.engine.step_log.clear()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    acceptance = sum(o.stats.accepted for o in outputs) / sum(o.stats.steps for o in outputs)
    return [o.token_ids for o in outputs], list(llm.engine.step_log), acceptance


def fused_op_calls(function):
    """function()'s result and how often it ran the fused op (counted at run time: on an FX-graph-cache hit the
    passes do not run again, so their own counts would say nothing)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        result = function()
    return result, sum(event.count for event in profiler.key_averages() if event.key == "compiled_spec::hisparse_attention")


# --- options -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, named", [
    (HiSparseConfig(top_k_tokens=0), "top_k_tokens=0 is out of range"),
    (HiSparseConfig(top_k_tokens=16, hot_rows=8), "hot_rows=8 is smaller than top_k_tokens=16"),
    (HiSparseConfig(top_k_tokens=4, hot_rows=7), "hot_rows=7 is too small: a decode pass writes up to 4 new rows"),
    (HiSparseConfig(hot_rows=0), "hot_rows=0 is out of range"),
    (HiSparseConfig(scorer="magic"), "scorer='magic' is not known"),
    (HiSparseConfig(cold_dtype="int8"), "cold_dtype='int8' is not supported; choose one of: float32, bfloat16"),
    (HiSparseConfig(cold_pool="disk"), "cold_pool='disk' is not known; choose one of: auto, host, device"),
    (HiSparseConfig(scorer="indexer"), "scorer='indexer' needs lightning-indexer weights"),
    ({"top_k_tokens": 4}, "must be None or a HiSparseConfig"),
])
def test_bad_options_are_clear_errors(tiny_checkpoint, config, named):
    with pytest.raises(CompiledSpecError, match=named.replace("(", r"\(").replace(")", r"\)")):
        LLM(tiny_checkpoint("predictive").path, hisparse=config, warm_up=False, **MIRROR_ENGINE)


def test_a_token_trees_leaves_count_against_the_hot_buffer(tiny_checkpoint):
    tree = dict(MIRROR_ENGINE, num_speculative_tokens=None, draft_tree="2,2")
    with pytest.raises(CompiledSpecError, match=r"hot_rows=8 is too small: a decode pass writes up to 5 new rows per "
                                                r"layer \(num_speculative_tokens=2 and a token tree's 2 leaves\) "
                                                r"besides the top_k_tokens=4 it reads; use hot_rows >= 9"):
        LLM(tiny_checkpoint("predictive").path, hisparse=SATURATED, warm_up=False, **tree)
    LLM(tiny_checkpoint("predictive").path, hisparse=dataclasses.replace(SATURATED, hot_rows=9), warm_up=False, **tree)


@pytest.mark.parametrize("cold_pool, device, pinned", [
    ("auto", "cuda", True), ("host", "cuda", True), ("device", "cuda", False),
    ("auto", "cpu", False), ("host", "cpu", False), ("device", "cpu", False),
])
def test_the_cold_pool_is_pinned_in_host_memory_on_cuda_unless_asked_for_device_memory(cold_pool, device, pinned):
    assert HiSparseConfig(cold_pool=cold_pool).cold_pool_pinned(torch.device(device)) is pinned


def test_a_pinned_cold_pool_is_refused_off_cuda():
    from compiled_spec.hisparse.host_pool import pinned_host_caches

    with pytest.raises(CompiledSpecError, match="a cold pool in pinned host memory needs a CUDA device, not cpu"):
        pinned_host_caches((2, 3), torch.float32, 2, torch.device("cpu"))


def test_off_by_default_adds_no_state(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("predictive").path, warm_up=False, **MIRROR_ENGINE)
    assert llm.engine.state.hisparse is None
    assert all(layer.self_attn.indexer is None for layer in llm.model.layers)


# --- the tiers -----------------------------------------------------------------------------------------------

def test_lru_residency_swap_in_and_overflow():
    capacity, rows = 16, 4
    cold_keys = torch.arange(capacity, dtype=torch.float32).view(1, capacity, 1, 1).expand(1, capacity, 1, 2).clone()
    cold_values = -cold_keys
    hot_keys = torch.full((1, rows + 1, 1, 2), -99.0)
    hot_values = hot_keys.clone()
    hot_keys[0, :rows], hot_values[0, :rows] = cold_keys[0, :rows], cold_values[0, :rows]
    positions = torch.tensor([[0, 1, 2, 3, -1]])
    last_used = torch.tensor([[5, 1, 7, 3, NEVER_EVICT]])
    clock = torch.tensor([20])

    # A new row at position 10 replaces the least recently used row (position 1).
    new = torch.full((1, 1, 1, 2), 10.0)
    tiers = place_new_rows(hot_keys, hot_values, positions, last_used, new, -new, torch.tensor([[10]]), clock)
    assert tiers[2].tolist() == [[0, 10, 2, 3, -1]]
    assert tiers[3].tolist() == [[5, 20, 7, 3, NEVER_EVICT]]

    # Selecting 2, 6, 0: hits stay, the miss (6) takes the LRU row nobody in this pass uses (position 3).
    selected, valid, live = torch.tensor([[[0, 2, 6]]]), torch.ones(1, 1, 3, dtype=torch.bool), torch.tensor([True])
    keys, values, positions, last_used = swap_in(*tiers, cold_keys, cold_values, selected, valid, clock, live)
    assert positions.tolist() == [[0, 10, 2, 6, -1]]
    assert last_used.tolist() == [[20, 20, 20, 20, NEVER_EVICT]]
    assert keys[0, 3].tolist() == [[6.0, 6.0]] and values[0, 3].tolist() == [[-6.0, -6.0]]

    # Next pass: four misses, but only rows not used by this pass may go; what does not fit is read from cold.
    clock = torch.tensor([21])
    selected = torch.tensor([[[11, 12, 13, 14]]])
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    keys, values, positions, last_used = swap_in(keys, values, positions, last_used, cold_keys, cold_values,
                                                 selected, valid, clock, live)
    assert positions.tolist() == [[11, 12, 13, 14, -1]]
    assert last_used[0, -1] == NEVER_EVICT
    read_keys, _ = gather_selected(keys, values, positions, cold_keys, cold_values, torch.tensor([[[2, 11, 14]]]))
    assert read_keys[0, 0, :, 0, 0].tolist() == [2.0, 11.0, 14.0]  # 2 comes from the cold pool


def random_tiers(seed, batch=3, length=3, heads=4, kv_heads=2, dim=8, capacity=40, rows=10, index_heads=2,
                 index_dim=6, top_k=5, weighted=True):
    """A valid tier state (each position resident at most once, empty rows least recently used) and one pass."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    start = torch.randint(5, capacity - length - 2, (batch,), generator=generator)
    query_positions = start[:, None] + torch.arange(length)
    live = torch.ones(batch, dtype=torch.bool)
    live[-1] = bool(seed % 2)
    write_positions = torch.where(live[:, None], query_positions, -1)
    write_positions[0, -1] = -1
    positions = torch.full((batch, rows + 1), -1)
    last_used = torch.zeros(batch, rows + 1, dtype=torch.int64)
    for b in range(batch):
        held = torch.randperm(int(start[b]) + length, generator=generator)[: rows - 2]
        positions[b, : len(held)] = held
        last_used[b, : len(held)] = torch.randint(1, 50, (len(held),), generator=generator)
    last_used[:, -1] = NEVER_EVICT
    attend = torch.arange(capacity)[None, None] <= query_positions[:, :, None]
    return (
        randn(batch, length, heads, dim), randn(batch, length, kv_heads, dim), randn(batch, length, kv_heads, dim),
        randn(batch, length, index_heads, index_dim), randn(batch, length, index_heads).abs() if weighted else None,
        randn(batch, capacity, index_dim), randn(batch, capacity, kv_heads, dim), randn(batch, capacity, kv_heads, dim),
        randn(batch, rows + 1, kv_heads, dim), randn(batch, rows + 1, kv_heads, dim), positions, last_used,
        write_positions, attend, query_positions.max(1).values + 1, live, top_k,
    )


def tier_case(seed):
    """random_tiers for one seed: every third has more wanted rows than fit (some are read from cold), and
    seeds 1, 5, 9, ... score without indexer head weights."""
    small = dict(rows=6, top_k=3) if seed % 3 == 0 else {}
    return random_tiers(seed, weighted=seed % 4 != 1, **small)


@pytest.mark.parametrize("seed", range(12))
def test_fused_op_equals_the_reference(seed):
    args = tier_case(seed)
    reference, fused = sparse_attention(*args), hisparse_attention(*args)
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-5, atol=1e-5)
    for fused_rows, reference_rows in zip(fused[1:3], reference[1:3]):
        assert torch.equal(fused_rows[:, :-1], reference_rows[:, :-1])  # the trash row holds anything
    assert torch.equal(fused[3], reference[3]) and torch.equal(fused[4], reference[4])


# --- the fusion pass -----------------------------------------------------------------------------------------

class RecordOps:
    """A pass that records the graph's ops (for showing the graph before and after the fusion pass)."""

    def __init__(self):
        self.ops: list[str] = []

    def __call__(self, graph, context):
        self.ops = [str(node.target) for node in graph.nodes if node.op == "call_function"]
        return []


def test_fusion_pass_replaces_the_decomposed_subgraph_with_the_fused_op():
    weighted, unweighted = random_tiers(1), random_tiers(2, weighted=False, rows=6)  # top_k=5, as configured
    projection = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)) * 0.3

    def two_layers(first, second):
        # Two tiered layers, one with indexer head weights and one training-free, the tiers written back in place.
        out = []
        for args in (first, second):
            result = sparse_attention(args[0] @ projection, *args[1:-1], args[-1])
            for buffer, value in zip(args[8:12], result[1:]):
                buffer.copy_(value)
            out.append(result[0])
        return out[0].sum() + out[1].sum(), out[0] * 2

    before, after = RecordOps(), RecordOps()
    fusion = HiSparseFusionPass(HiSparseConfig(top_k_tokens=5, hot_rows=10))
    manager = SpecPassManager([before, fusion, after], PassContext("fusion test", ()))
    compiled = torch.compile(two_layers, fullgraph=True, dynamic=False, backend=spec_backend({}, manager))

    def copies():
        return [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) for args in (weighted, unweighted)]

    eager_args, compiled_args = copies(), copies()
    expected = two_layers(*eager_args)
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        got = compiled(*compiled_args)

    fused_op = "compiled_spec.hisparse_attention.default"
    assert fusion.matches == 2
    assert before.ops.count("aten.topk.default") == 2 and fused_op not in before.ops
    assert after.ops.count(fused_op) == 2
    assert not {"aten.topk.default", "aten.sort.default", "aten.scatter.src", "aten.bmm.default"} & set(after.ops)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for eager_layer, compiled_layer in zip(eager_args, compiled_args):
        assert torch.equal(eager_layer[10], compiled_layer[10]) and torch.equal(eager_layer[11], compiled_layer[11])
        torch.testing.assert_close(eager_layer[8][:, :-1], compiled_layer[8][:, :-1])


def test_the_pass_manager_uuid_covers_the_hisparse_config():
    def uuid(config):
        return SpecPassManager([HiSparseFusionPass(config)], PassContext("g", (), {"hisparse": repr(config)})).uuid()

    assert uuid(HiSparseConfig(4, 8)) == uuid(HiSparseConfig(4, 8))
    assert uuid(HiSparseConfig(4, 8)) != uuid(HiSparseConfig(5, 9))


# --- end to end ----------------------------------------------------------------------------------------------

def test_top_k_covering_the_context_equals_dense_eager(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    prompts = prompts_for(PROMPT_LENGTHS)
    dense = run(LLM(path, **MIRROR_ENGINE), prompts)
    sparse = LLM(path, hisparse=HiSparseConfig(top_k_tokens=64, hot_rows=68), **MIRROR_ENGINE)
    assert all(isinstance(layer.self_attn.indexer, KeyScorer) for layer in sparse.model.layers)
    assert run(sparse, prompts)[:2] == dense[:2]


@pytest.fixture(scope="session")
def indexer_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The predictive checkpoint plus random lightning-indexer weights (2 heads of 8) for every attention layer."""
    source = tiny_checkpoint("predictive").path
    path = tmp_path_factory.mktemp("predictive_indexer")
    for file in source.iterdir():
        shutil.copy(file, path / file.name)
    generator = torch.Generator().manual_seed(4)
    weights = {}
    for layer in range(3):  # the main layer, then the two MTP modules (DeepSeek layout: model.layers.{1 + j})
        prefix = f"model.layers.{layer}.self_attn.indexer"
        weights[f"{prefix}.wq.weight"] = 0.1 * torch.randn(16, 64, generator=generator)
        weights[f"{prefix}.wk.weight"] = 0.1 * torch.randn(8, 64, generator=generator)
        weights[f"{prefix}.weights_proj.weight"] = 0.1 * torch.randn(2, 64, generator=generator)
    save_file(weights, str(path / "model-indexer.safetensors"))
    return path


def test_lightning_indexer_weights_load_for_main_and_draft_layers(tiny_checkpoint, indexer_checkpoint):
    prompts = prompts_for(PROMPT_LENGTHS[:4])
    dense = run(LLM(tiny_checkpoint("predictive").path, **MIRROR_ENGINE), prompts)
    llm = LLM(indexer_checkpoint, hisparse=HiSparseConfig(top_k_tokens=64, hot_rows=68, scorer="indexer"), **MIRROR_ENGINE)
    indexers = [layer.self_attn.indexer for layer in llm.model.layers] + [m.block.self_attn.indexer for m in llm.model.mtp]
    assert all(isinstance(indexer, LightningIndexer) and indexer.num_heads == 2 for indexer in indexers)
    assert [tensor.shape[-1] for tensor in llm.engine.state.hisparse.index_keys] == [8, 8, 8]
    assert run(llm, prompts)[:2] == dense[:2]
    sparse = run(LLM(indexer_checkpoint, hisparse=HiSparseConfig(top_k_tokens=4, hot_rows=8), **MIRROR_ENGINE), prompts)
    assert sparse[0] != dense[0]  # a small top-k does attend to fewer tokens


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compile", "piecewise"])
def test_top_k_covering_the_context_equals_dense_in_every_graph_mode(tiny_checkpoint, mode):
    """full: its tokens and accepted counts equal eager's with HiSparse (the saturated tests below, and the
    tiered start), and eager's equal dense here; a full compile of this configuration would add 2 min."""
    path = tiny_checkpoint("predictive").path
    prompts = prompts_for((3, 11, 6), seed=1)
    dense = run(LLM(path, **DENSE_ENGINE), prompts, max_tokens=12)
    llm = LLM(path, graph_mode=mode, hisparse=HiSparseConfig(top_k_tokens=32, hot_rows=34), show_progress=False,
              **DENSE_ENGINE)
    with torch.compiler.set_stance("fail_on_recompile"):
        result, calls = fused_op_calls(lambda: run(llm, prompts, max_tokens=12))
    assert result[:2] == dense[:2]
    assert calls == 2 * len(result[1])  # the step's main layer and its draft layer, every step


def record_evictions(llm: LLM) -> list[int]:
    """Per step: hot rows whose resident position was replaced by another, over every slot and tiered layer."""
    runner, state, evictions = llm.engine.runner, llm.engine.state, []
    step = runner.step

    def counting_step(batch_size, drafts):
        before = [positions.clone() for positions in state.hisparse.hot_positions]
        step(batch_size, drafts)
        evictions.append(sum(int(((old >= 0) & (old != new)).sum()) for old, new in zip(before, state.hisparse.hot_positions)))

    runner.step = counting_step
    return evictions


@pytest.fixture(scope="session")
def mirror_workload(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    prompts = prompts_for(PROMPT_LENGTHS)
    eager = LLM(path, hisparse=SATURATED, **MIRROR_ENGINE)
    evictions = record_evictions(eager)
    return path, prompts, run(eager, prompts), evictions


@pytest.mark.slow
@pytest.mark.xdist_group("mirror_full_packages")  # test_tiered_start[hisparse] loads them
def test_full_mode_equals_eager_with_a_saturated_hot_buffer(mirror_workload):
    path, prompts, (eager_tokens, eager_steps, _), evictions = mirror_workload
    # Prefill leaves the hot buffers empty; from the second step on, every step evicts.
    assert all(count > 0 for count in evictions[1:]), evictions
    accepted = [count for step in eager_steps for _, count in step]
    assert {0, 1, 2} <= set(accepted)
    llm = LLM(path, graph_mode="full", hisparse=SATURATED, show_progress=False, **MIRROR_ENGINE)
    with torch.compiler.set_stance("fail_on_recompile"):
        (tokens, steps, _), calls = fused_op_calls(lambda: run(llm, prompts))
    assert calls == 3 * len(steps)  # the main layer and both draft depths, every step
    assert tokens == eager_tokens
    assert steps == eager_steps


@pytest.mark.slow
def test_a_bfloat16_cold_pool_halves_its_memory_and_full_mode_still_equals_eager(mirror_workload):
    path, prompts, _, _ = mirror_workload
    compact = dataclasses.replace(SATURATED, cold_dtype="bfloat16")
    eager = LLM(path, hisparse=compact, **MIRROR_ENGINE)
    state = eager.engine.state
    assert {t.dtype for t in state.main_keys + state.draft_values} == {torch.bfloat16}
    assert {t.dtype for t in state.hisparse.hot_keys + state.hisparse.hot_values} == {torch.float32}
    eager_tokens, eager_steps, acceptance = run(eager, prompts)
    assert acceptance > 0.6
    # Every resident row is backed up: the cold pool holds it, rounded to bfloat16 (main layer and both depths).
    for layer, cold in enumerate(state.main_keys + state.draft_keys):
        hot, positions = state.hisparse.hot_keys[layer], state.hisparse.hot_positions[layer]
        slots, rows = (positions >= 0).nonzero(as_tuple=True)
        assert len(slots) > 0
        assert torch.equal(cold[slots, positions[slots, rows]], hot[slots, rows].bfloat16())
    llm = LLM(path, graph_mode="full", hisparse=compact, show_progress=False, **MIRROR_ENGINE)
    with torch.compiler.set_stance("fail_on_recompile"):
        (tokens, steps, _), calls = fused_op_calls(lambda: run(llm, prompts))
    assert calls == 3 * len(steps)
    assert tokens == eager_tokens and steps == eager_steps


def faulty_engine(path, mode: GraphMode, passes):
    llm = LLM(path, graph_mode=mode, hisparse=without_draft_mirror(SATURATED), warm_up=False, **MIRROR_ENGINE)
    engine = llm.engine
    engine.runner = StepRunner(llm.model, engine.state, engine.constants, mode, engine.runner.step_drafts,
                               passes=passes)
    return llm


@pytest.mark.slow
def test_without_the_draft_mirror_acceptance_collapses_in_full_mode_but_output_stays_right(mirror_workload):
    path, prompts, (eager_tokens, _, eager_acceptance), _ = mirror_workload
    # Only the fusion pass: the state-mutation pass would reject this step (next test).
    llm = faulty_engine(path, GraphMode.FULL, passes=[HiSparseFusionPass(SATURATED)])
    prefilling_in_eager(llm.engine.runner)  # the step is what reads the stale rows
    llm.engine.startup.warm_up(show_progress=False)
    tokens, _, acceptance = run(llm, prompts)
    # The target verifies every draft, so the text is right; the drafts read stale KV swapped in from the cold pool.
    assert tokens == eager_tokens
    assert eager_acceptance > 0.6
    assert acceptance < 0.75 * eager_acceptance, (acceptance, eager_acceptance)


def test_the_state_mutation_pass_rejects_a_step_without_the_draft_mirror(tiny_checkpoint):
    llm = faulty_engine(tiny_checkpoint("predictive").path, GraphMode.COMPILE, passes=None)
    with pytest.raises(Exception) as info:
        llm.engine.startup.warm_up(show_progress=False)
    assert "decode state updated outside the graph: draft_keys[0], draft_keys[1], draft_values[0]" in audit_failure(info.value)


# --- CLI -----------------------------------------------------------------------------------------------------

def generate_command(*args):
    from click.testing import CliRunner

    from compiled_spec import cli

    return CliRunner().invoke(cli.main, ["generate", *args], prog_name="compiled-spec")


def test_cli_generates_with_hisparse(tiny_checkpoint):
    model = str(tiny_checkpoint("predictive").path)
    common = ["--prompt-ids", "2,3,4,5,6,7", "--model", model, "-k", "2", "--max-tokens", "6", "--max-seq-len", "64",
              "--ignore-eos", "--json"]
    dense = generate_command(*common)
    sparse = generate_command(*common, "--hisparse", "--top-k-tokens", "64", "--hot-rows", "68", "--cold-pool", "host")
    assert sparse.exit_code == 0, sparse.output
    assert sparse.stdout.splitlines()[0].split('"stats"')[0] == dense.stdout.splitlines()[0].split('"stats"')[0]
    compact = generate_command(*common, "--hisparse", "--top-k-tokens", "8", "--hot-rows", "12", "--cold-dtype", "bfloat16")
    assert compact.exit_code == 0, compact.output
    assert len(json.loads(compact.stdout.splitlines()[0])["token_ids"]) == 6


@pytest.mark.parametrize("args, named", [
    (["--hisparse", "--top-k-tokens", "0"], "top_k_tokens=0 is out of range"),
    (["--hisparse", "--top-k-tokens", "8", "--hot-rows", "4"], "hot_rows=4 is smaller than top_k_tokens=8"),
    (["--top-k-tokens", "8"], "--top-k-tokens, --hot-rows, --cold-dtype and --cold-pool need --hisparse"),
    (["--cold-dtype", "bfloat16"], "--top-k-tokens, --hot-rows, --cold-dtype and --cold-pool need --hisparse"),
    (["--cold-pool", "host"], "--top-k-tokens, --hot-rows, --cold-dtype and --cold-pool need --hisparse"),
    (["--hisparse", "--cold-pool", "disk"], "'disk' is not one of 'auto', 'host', 'device'"),
    (["--hisparse", "--cold-dtype", "int8"], "'int8' is not one of 'float32', 'bfloat16', 'float16'"),
])
def test_cli_bad_hisparse_options_are_one_error_line(tiny_checkpoint, args, named):
    result = generate_command("--prompt-ids", "2,3", "--model", str(tiny_checkpoint("predictive").path),
                              "--max-seq-len", "64", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and named in result.stderr


@pytest.mark.parametrize("name, mtp_prefixes", [
    ("predictive", ["model.layers.1", "model.layers.2"]),
    ("llama_mimo", ["model.mtp_layers.0", "model.mtp_layers.1"]),
    ("llama_mtp_indexed", ["mtp.0", "mtp.1"]),
])
def test_trained_indexer_weights_are_named_in_the_checkpoint_layout(tiny_checkpoint, name, mtp_prefixes):
    from compiled_spec.training.train_indexer import checkpoint_prefixes

    checkpoint = tiny_checkpoint(name)
    layers = checkpoint.model.config.num_hidden_layers
    expected = {f"layers.{i}": f"model.layers.{i}" for i in range(layers)}
    expected.update({f"mtp.{j}.block": prefix for j, prefix in enumerate(mtp_prefixes)})
    assert checkpoint_prefixes(checkpoint.path, layers) == expected
