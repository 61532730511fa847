"""Tiered start (full on CPU): the engine decodes in eager while the full packages compile in a child process, and
switches to them between two steps. The step is a pure function of the persistent state, so a switch in the middle
of requests changes no token and no accepted count, and nothing compiles after it."""

from __future__ import annotations

import dataclasses

import logging
import re
import time
from collections import deque

import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.config import GraphMode
from compiled_spec.compiler.step_runner import StepRunner, graphs_made
from test_graph_modes import ENGINE, PROMPT_LENGTHS
from test_hisparse import MIRROR_ENGINE, SATURATED, prompts_for

SWITCH_AT_STEP = 5


def mixed_requests(llm: LLM, prompts):
    """Greedy and seeded sampling, alternating: both kinds of accept test run before and after the switch."""
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.9, seed=11)
    return [llm.make_request(i, prompt, greedy if i % 2 == 0 else sampled) for i, prompt in enumerate(prompts)]


def decode(llm: LLM, prompts, switch_to: StepRunner | None = None):
    """Tokens per request and (request, accepted) per lane per step; with switch_to, the engine switches to it
    before step SWITCH_AT_STEP, while requests are in flight and others wait."""
    engine = llm.engine
    requests = mixed_requests(llm, prompts)
    queue, steps = deque(requests), []
    while queue or engine.slots:
        while queue and engine.has_free_slot():
            engine.admit(queue.popleft())
        if switch_to is not None and len(steps) == SWITCH_AT_STEP:
            assert engine.slots and queue
            engine.startup.switch_runner(switch_to, [switch_to.warm_up_call(*graph) for graph in engine.startup.warm_up_graphs(switch_to)])
        steps.append(engine.step().lanes)
    return [request.output.token_ids for request in requests], steps


@pytest.mark.slow
@pytest.mark.parametrize("hisparse", [
    # On the worker that compiled these configurations in full (test_graph_modes, test_hisparse): loaded, not compiled.
    pytest.param(None, id="dense", marks=pytest.mark.xdist_group("full_engine_packages")),
    pytest.param(SATURATED, id="hisparse", marks=pytest.mark.xdist_group("mirror_full_packages")),
])
def test_a_switch_from_eager_to_full_mid_request_changes_no_token_and_no_accepted_count(tiny_checkpoint, hisparse):
    path = tiny_checkpoint("predictive").path
    engine_options = MIRROR_ENGINE if hisparse else ENGINE  # the configurations other tests compile in full
    prompts = prompts_for(PROMPT_LENGTHS) if hisparse else prompts_for(PROMPT_LENGTHS[:10], seed=3)
    eager_tokens, eager_steps = decode(LLM(path, graph_mode="eager", hisparse=hisparse, **engine_options), prompts)
    accepted = {count for step in eager_steps for _, count in step}
    assert {0, 2} <= accepted, accepted  # rejections and full acceptance on both sides of the switch

    llm = LLM(path, graph_mode="full", hisparse=hisparse, show_progress=False, **engine_options)
    engine = llm.engine
    full = engine.runner
    engine.startup.switch_runner(StepRunner(llm.model, engine.state, engine.constants, GraphMode.EAGER,
                                            full.step_drafts))
    graphs = graphs_made(full)
    with torch.compiler.set_stance("fail_on_recompile"):
        tokens, steps = decode(llm, prompts, switch_to=full)
    assert engine.runner is full and engine.switches == [0, SWITCH_AT_STEP]
    assert graphs_made(full) == graphs  # the switch loaded what warm-up made; nothing compiled after it
    assert tokens == eager_tokens
    assert steps == eager_steps


@pytest.mark.slow
def test_a_first_start_answers_in_eager_while_full_compiles_in_the_background_then_switches(
        tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing compiled yet
    path = tiny_checkpoint("predictive").path
    options = dict(num_speculative_tokens=2, max_batch_size=2, max_seq_len=32, batch_buckets=(2,), prefill_buckets=(32,))
    prompts = prompts_for((4, 9, 6), seed=5)
    reference = decode(LLM(path, graph_mode="eager", **options), prompts)

    llm = LLM(path, graph_mode="full", background_compile=True, compile_workers=2, show_progress=False, **options)
    engine = llm.engine
    assert engine.runner.mode == GraphMode.EAGER and engine.startup.background is not None
    assert engine.startup.background.process is not None  # this engine started the child
    log = engine.startup.background.log
    first = decode(llm, prompts)  # served at once, in eager (the child is still importing torch)
    assert first == reference
    assert "compiling in the background" in engine.startup.graph_mode_run()
    follower = LLM(path, graph_mode="full", background_compile=True, show_progress=False, **options).engine
    assert follower.startup.background.process is None and follower.startup.background.pid == engine.startup.background.pid  # no second child

    assert engine.startup.poll_background(wait=True, timeout=900) == "ready", engine.startup.background and engine.startup.background.failure()
    assert engine.runner.mode == GraphMode.FULL and engine.startup.background is None
    ready = re.findall(r"^ready: (\S+) \(pid (\d+), [\d.]+ s\)$", log.read_text(), re.MULTILINE)
    names = sorted(engine.runner.package_path(*graph).name for graph in engine.startup.warm_up_graphs())
    assert sorted(name for name, _ in ready) == names  # the step and the prefill graph, one in each process
    assert len({pid for _, pid in ready}) == 2, ready
    assert engine.startup.graph_mode_run() == f"eager, then full from step {engine.switches[0] + 1}"
    with torch.compiler.set_stance("fail_on_recompile"):
        assert decode(llm, prompts) == reference
    assert follower.startup.poll_background(wait=True, timeout=60) == "ready" and follower.runner.mode == GraphMode.FULL

    later = LLM(path, graph_mode="full", background_compile=True, show_progress=False, **options)
    assert later.engine.startup.background is None and later.engine.runner.mode == GraphMode.FULL  # a warm start loads them
    compiled, loaded = later.engine.runner.packages()
    assert compiled == [] and len(loaded) == len(later.engine.startup.warm_up_graphs())


@pytest.mark.parametrize("fault", ["model gone", "other packages"])
def test_a_failed_background_compile_warns_once_the_engine_keeps_serving_in_eager_and_no_later_start_retries_it(
        tiny_checkpoint, tmp_path, monkeypatch, caplog, fault):
    """The child fails to build the engine (its model is gone), or builds one that names other packages than the
    parent (as when the CPU kernels built in one process and not the other): either way one warning, eager serving,
    and a later start with the same packages decodes in eager at once instead of starting the same doomed child."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = tiny_checkpoint("predictive").path
    options = dict(num_speculative_tokens=1, max_batch_size=2, max_seq_len=24, batch_buckets=(2,), prefill_buckets=(24,))
    prompts = prompts_for((4, 7), seed=2)
    reference = decode(LLM(path, graph_mode="eager", **options), prompts)
    llm = LLM(path, graph_mode="full", background_compile=True, compile_workers=2, show_progress=False, warm_up=False,
              **options)
    start = llm.engine.startup.options
    if fault == "model gone":
        start.spec = dataclasses.replace(start.spec, model=tmp_path / "gone")  # neither compile process can load it
    else:
        start.spec = start.spec.with_config(max_seq_len=32)  # the child's engine keys its packages differently
    llm.engine.startup.warm_up(show_progress=False)
    with caplog.at_level(logging.WARNING):
        assert llm.engine.startup.poll_background(wait=True, timeout=300) == "failed"
        assert decode(llm, prompts) == reference
        assert decode(llm, prompts) == reference
    warnings = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "compiling the full graphs failed" in warnings[0].getMessage()
    why = "gone" if fault == "model gone" else "differs from the one the engine expects"
    assert why in warnings[0].getMessage()  # the child's own error, from its log
    assert llm.engine.runner.mode == GraphMode.EAGER and llm.engine.startup.background is None

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        later = LLM(path, graph_mode="full", background_compile=True, compile_workers=2, show_progress=False,
                    **options)
        assert later.engine.startup.background is None  # no child started: nothing competes with decoding for the cores
        assert later.engine.runner.mode == GraphMode.EAGER
        assert decode(later, prompts) == reference
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "failed to compile in an earlier run" in warnings[0] and why in warnings[0]


class FinishedCompile:
    """A background compile that reports every package made (the switch then loads them)."""

    started, log = time.perf_counter(), "compile.log"

    def poll(self) -> str:
        return "ready"

    def stop(self) -> None:
        pass


def test_a_failed_switch_to_the_full_graphs_warns_once_and_the_engine_keeps_serving_in_eager(
        tiny_checkpoint, monkeypatch, caplog):
    path = tiny_checkpoint("predictive").path
    options = dict(num_speculative_tokens=1, max_batch_size=2, max_seq_len=24, batch_buckets=(2,), prefill_buckets=(24,))
    prompts = prompts_for((4, 7), seed=2)
    reference = decode(LLM(path, graph_mode="eager", **options), prompts)
    llm = LLM(path, graph_mode="eager", show_progress=False, **options)
    engine = llm.engine
    eager = engine.runner
    full = StepRunner(llm.model, engine.state, engine.constants, GraphMode.EAGER, eager.step_drafts)

    def load(function, args):
        raise RuntimeError("the package does not load")

    monkeypatch.setattr(full, "load", load)
    engine.startup.background, engine.startup._full_runner = FinishedCompile(), full  # as _start_in_eager leaves them
    with caplog.at_level(logging.WARNING):
        assert decode(llm, prompts) == reference
        assert decode(llm, prompts) == reference
    warnings = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "switching to the full graphs failed" in warnings[0].getMessage()
    assert "the package does not load" in warnings[0].getMessage()
    assert engine.runner is eager and engine.startup.background is None and engine.switches == []
