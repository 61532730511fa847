"""The graph canary (engine/canary.py): a compiled step that writes anything eager does not is caught within N
steps, replaced by eager's result, and the engine falls back to a safer mode; the output then equals eager's.

Each fault is one the compile-time passes would reject, so they are off here (passes=[]): the canary is what catches
what the passes miss, and it compares the whole state, not the fields a fault is known to touch.
"""

from __future__ import annotations

import logging

import pytest
import torch

from compiled_spec import LLM, CompiledSpecError, GraphMode, SamplingParams
from compiled_spec.engine.canary import Divergence, GraphCanary, copy_state, first_difference
from compiled_spec.compiler.step_runner import StepRunner
from compiled_spec.speculative.step import Drafts
from faults import PositionsInPythonRunner, ScaledStateWrite, prefilling_in_eager, step_without_draft_counts
from compiled_spec.passes.graph_inputs import state_field
from test_auto_k import ScheduledChooser

ENGINE = dict(num_speculative_tokens=2, max_batch_size=2, max_seq_len=64, batch_buckets=(2,), prefill_buckets=(16,))
AUTO_ENGINE = {**ENGINE, "num_speculative_tokens": "auto", "max_speculative_tokens": 2}
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def workload(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    generator = torch.Generator().manual_seed(4)
    # As many prompts as slots: every request is admitted before the first step (a prefill graph would add a
    # compile and test nothing here).
    return path, [torch.randint(2, 96, (n,), generator=generator).tolist() for n in (5, 9)], [GREEDY, SEEDED]


def run(llm: LLM, prompts, params):
    llm.engine.step_log.clear()
    outputs = llm.generate(prompts, params)
    return [o.token_ids for o in outputs], list(llm.engine.step_log)


def eager_state(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("predictive").path, graph_mode="eager", **ENGINE)
    llm.generate([[3, 4, 5]], GREEDY)
    return llm.engine.state


def test_first_difference_names_the_field_and_lane(tiny_checkpoint):
    state = eager_state(tiny_checkpoint)
    copy = copy_state(state)
    assert first_difference(state, copy, step=7) is None
    copy.draft_probs[1, 0, 3] += 1e-6  # within the float tolerance
    assert first_difference(state, copy, step=7) is None
    copy.draft_probs[1, 0, 3] += 0.01
    difference = first_difference(state, copy, step=7)
    assert (difference.field, difference.lane, difference.step) == ("draft_probs", 1, 7)
    copy = copy_state(state)
    copy.main_keys[0][1, 2] += 1.0
    copy.step_accepted[1] += 1  # integers: exactly; the first field in field order is named
    difference = first_difference(state, copy, step=3)
    assert (difference.field, difference.lane) == ("step_accepted", 1)
    assert str(difference).startswith("graph divergence at step 3: step_accepted differs in lane 1")


def test_the_rate_is_checked(tiny_checkpoint):
    with pytest.raises(CompiledSpecError, match="verify_graphs_every=-1 must be 0"):
        LLM(tiny_checkpoint("predictive").path, verify_graphs_every=-1, warm_up=False, **ENGINE)
    with pytest.raises(ValueError):
        GraphCanary(0)
    canary, checked = GraphCanary(4), []
    for step in range(1, 10):
        due = canary.due(step)
        if due:
            checked.append(step)
        canary.observe(step, 0.01, due)
    assert checked == [4, 8]


def test_a_budget_stretches_the_interval():
    canary = GraphCanary(4, budget=0.02)
    for step in range(1, 4):
        canary.observe(step, 0.01, checked=False)  # a step: 10 ms
    canary.extra_seconds = 0.05  # a check: 50 ms more
    canary.observe(4, 0.06, checked=True)
    # 50 ms in N steps of 10 ms is at most 2% from N = 50 * 0.98 / (0.02 * 10) = 245 on.
    assert canary.next_check == 4 + 245
    unbudgeted = GraphCanary(4)
    unbudgeted.extra_seconds = 0.05
    unbudgeted.observe(4, 0.06, checked=True)
    assert unbudgeted.next_check == 8


def check_fell_back(llm: LLM, every: int, first_faulty_step: int, mode: GraphMode, caplog):
    divergences = llm.engine.canary.divergences
    assert len(divergences) == 1  # then the engine runs the safer mode, which the canary checks too
    assert first_faulty_step <= divergences[0].step < first_faulty_step + every
    assert llm.engine.fallbacks == [mode] and llm.engine.runner.mode == mode
    lines = [r.getMessage() for r in caplog.records if "graph divergence" in r.getMessage()]
    assert lines == [f"compiled-spec: {divergences[0]}; falling back from {lines[0].split('from ')[1].split(' ')[0]} "
                     f"to {mode.value}"]
    return divergences[0]


@pytest.mark.slow
def test_a_graph_computing_what_eager_does_not_is_caught(workload, caplog):
    path, prompts, params = workload
    eager = run(LLM(path, graph_mode="eager", **ENGINE), prompts, params)
    llm = LLM(path, graph_mode="compile", warm_up=False, verify_graphs_every=1, **ENGINE)
    engine = llm.engine
    engine.runner = prefilling_in_eager(StepRunner(llm.model, engine.state, engine.constants, GraphMode.COMPILE,
                                                   engine.runner.step_drafts, passes=[ScaledStateWrite("draft_probs", 0.5)]))
    with caplog.at_level(logging.WARNING, logger="compiled_spec.canary"):
        assert run(llm, prompts, params) == eager
    divergence = check_fell_back(llm, 1, 1, GraphMode.EAGER, caplog)
    assert divergence.field == "draft_probs"


@pytest.mark.slow
def test_a_fault_in_a_full_package_is_caught_and_the_engine_falls_back_to_compile(workload, caplog):
    """full, the default mode: its package compiled with a pass that zeroes the drafts the step writes (what a
    miscompiled package could do). Without the canary, acceptance and output change; with it, the engine catches the
    first step, falls back to compile, and tokens and accepted counts equal eager's."""
    path, prompts, params = workload
    eager = run(LLM(path, graph_mode="eager", **ENGINE), prompts, params)

    def faulty_full(every: int) -> LLM:
        llm = LLM(path, graph_mode="full", warm_up=False, verify_graphs_every=every, **ENGINE)
        engine = llm.engine
        engine.use_runner(prefilling_in_eager(StepRunner(llm.model, engine.state, engine.constants, GraphMode.FULL,
                                                         engine.runner.step_drafts, passes=[ScaledStateWrite("draft_tokens", 0)])),
                          initial=True)
        return llm

    unchecked = faulty_full(every=0)  # compiles the faulty package, which the checked engine loads
    assert run(unchecked, prompts, params) != eager, "the fault must change what is accepted, or the output"
    llm = faulty_full(every=1)
    with caplog.at_level(logging.WARNING, logger="compiled_spec.canary"):
        assert run(llm, prompts, params) == eager
    divergence = check_fell_back(llm, 1, 1, GraphMode.COMPILE, caplog)
    assert divergence.field == "draft_tokens"


@pytest.mark.slow
def test_a_step_that_skips_the_draft_count_write_is_caught(workload, caplog):
    path, prompts, params = workload
    every = 2
    schedule = [1]  # prefill drafts K=2; each step drafts 1, so each should count 1 valid draft
    reference = LLM(path, graph_mode="eager", **AUTO_ENGINE)
    reference.engine.chooser = ScheduledChooser(schedule)
    eager = run(reference, prompts, params)
    llm = LLM(path, graph_mode="compile", warm_up=False, verify_graphs_every=every, **AUTO_ENGINE)
    engine = llm.engine
    engine.chooser = ScheduledChooser(schedule)
    engine.runner = prefilling_in_eager(StepRunner(
        llm.model, engine.state, engine.constants, GraphMode.COMPILE, passes=[],
        step_function=step_without_draft_counts, step_drafts=(Drafts(0), Drafts(1), Drafts(2))))
    with caplog.at_level(logging.WARNING, logger="compiled_spec.canary"):
        assert run(llm, prompts, params) == eager
    divergence = check_fell_back(llm, every, 1, GraphMode.EAGER, caplog)
    assert divergence.field == "draft_counts"


@pytest.mark.slow
def test_state_updated_outside_a_captured_graph_is_caught(workload, caplog):
    """The seed bug's class: piecewise reads the buffer it captured, the runtime rebinds seq_lens in Python. The
    first step reads the right lengths, every later one stale ones; the canary (every 2nd step) catches step 2."""
    path, prompts, params = workload
    every = 2
    eager = run(LLM(path, graph_mode="eager", **ENGINE), prompts, params)
    llm = LLM(path, graph_mode="piecewise", warm_up=False, verify_graphs_every=every, **ENGINE)
    engine = llm.engine
    engine.runner = PositionsInPythonRunner(llm.model, engine.state, engine.constants, GraphMode.PIECEWISE,
                                            engine.runner.step_drafts, passes=[])
    with caplog.at_level(logging.WARNING, logger="compiled_spec.canary"):
        assert run(llm, prompts, params) == eager
    check_fell_back(llm, every, 2, GraphMode.COMPILE, caplog)


def test_divergence_reads_as_one_line():
    line = str(Divergence("seq_lens", 1, 4, "compiled 9, eager 10 at element 0"))
    assert "\n" not in line and "seq_lens" in line and "lane 1" in line and "step 4" in line


def test_divergences_are_counted_in_the_metrics():
    from prometheus_client import generate_latest

    from compiled_spec.server.metrics import ServerMetrics

    metrics = ServerMetrics("tiny", 2)
    metrics.graph_divergence.inc()
    assert 'compiled_spec:graph_divergence_total{model_name="tiny"} 1.0' in generate_latest(metrics.registry).decode()


@pytest.mark.slow
def test_the_servers_periodic_canary_catches_a_faulty_graph_counts_it_and_serves_eager_text_after(tmp_path):
    """`compiled-spec serve` at its own canary rate (every 256th step at most, within its time budget) with a compile
    graph that zeroes its drafts: the engine finds the divergence, /metrics counts it, /health says the engine fell
    back, and greedy text after it equals eager's with drafts accepted again."""
    import httpx
    from compiled_spec.benchmarks.live_server import running_server
    from serving import serve_command, write_chat_model

    model = write_chat_model(tmp_path / "model")
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "zero_drafts").touch()
    request = dict(model="tiny", prompt="ROMEO:", max_tokens=64, temperature=0, ignore_eos=True)
    eager = LLM(model, graph_mode="eager", num_speculative_tokens=2, max_batch_size=1, max_seq_len=80)
    expected = eager.generate("ROMEO:", SamplingParams(max_tokens=64, ignore_eos=True))[0].text
    command = serve_command(model, "-k", "2", "--max-batch-size", "1", "--max-seq-len", "80", "--graph-mode",
                            "compile", "--served-model-name", "tiny", "--log-level", "warning", faults=faults)
    divergences = 'compiled_spec:graph_divergence_total{model_name="tiny"}'
    # The server compiles four graphs before it answers /health: a minute each on a loaded 2-core machine.
    with running_server(command, tmp_path / "server.log", startup_timeout_s=900) as live:
        for _ in range(12):  # 64 steps each while the drafts are zeroed: the check at step 256 comes in the 5th
            response = httpx.post(live.base_url + "/v1/completions", json=request, timeout=300).json()
            if live.metrics()[divergences] >= 1:
                break
        assert live.metrics()[divergences] == 1
        assert httpx.get(live.base_url + "/health", timeout=30).json()["graph_mode"].startswith(
            "eager (the graph canary fell back to it at step ")
        response = httpx.post(live.base_url + "/v1/completions", json=request, timeout=300).json()
        assert response["choices"][0]["text"] == expected
        assert sum(response["usage"]["spec_decode"]["num_accepted_tokens_per_pos"]) > 0
    assert "graph divergence at step" in (tmp_path / "server.log").read_text()
