"""The audit and state-mutation passes: what they reject, and that the bug class they catch is real.

The bug class: decode state updated outside the graph. Here the runtime advances positions in Python
after each call; eager code sees that, a captured graph keeps reading its own buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from compiled_spec import LLM, GraphMode, SamplingParams
from compiled_spec.compiler.step_runner import spec_backend
from faults import PositionsInPythonRunner
from compiled_spec.passes import GraphAuditError, SpecPassManager, default_passes
from compiled_spec.passes.manager import PassContext

ENGINE = dict(num_speculative_tokens=2, max_batch_size=4, max_seq_len=64, batch_buckets=(4,), prefill_buckets=(64,))


def audit_failure(error: BaseException) -> str:
    """The GraphAuditError message inside the compiler's wrapping exceptions."""
    while error is not None:
        if isinstance(error, GraphAuditError):
            return str(error)
        error = error.__cause__ or error.__context__
    return ""


@dataclass(eq=False)
class ToyState:
    lengths: torch.Tensor
    tokens: torch.Tensor


def compile_toy(function, writes=("lengths",)):
    manager = SpecPassManager(default_passes(), PassContext(graph_name="toy", state_writes=writes))
    return torch.compile(function, fullgraph=True, dynamic=False, backend=spec_backend({}, manager)), manager


def toy_state():
    return ToyState(lengths=torch.zeros(4, dtype=torch.int64), tokens=torch.arange(4))


def test_in_place_state_update_passes_and_is_recorded():
    def step(state):
        state.lengths.index_copy_(0, torch.arange(2), state.lengths[:2] + state.tokens[:2])

    compiled, manager = compile_toy(step)
    state = toy_state()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled(state)
    assert state.lengths.tolist() == [0, 1, 0, 0]
    assert manager.context.last_written == ["lengths"]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("item", "host sync"),
        ("nonzero", "host sync"),
        ("returns_state", "returns tensors to Python"),
        ("update_elsewhere", "decode state updated outside the graph: lengths"),
    ],
)
def test_audit_rejects(case, expected):
    def item(state):
        state.lengths.add_(state.tokens.sum().item())

    def nonzero(state):
        state.lengths.add_(state.tokens.nonzero().sum())

    def returns_state(state):
        state.lengths.add_(1)
        return state.lengths * 2

    def update_elsewhere(state):
        return state.lengths + 1  # the caller is meant to apply it

    compiled, _ = compile_toy({"item": item, "nonzero": nonzero, "returns_state": returns_state,
                               "update_elsewhere": update_elsewhere}[case])
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True), \
            torch._inductor.config.patch(fx_graph_cache=False), pytest.raises(Exception) as info:
        compiled(toy_state())
    assert expected in audit_failure(info.value)


def test_a_cond_branch_is_audited_as_a_branch_and_the_graph_around_it_as_the_step():
    """Inductor runs the passes on each torch.cond branch first, as a graph of its own: a branch returns to its
    graph, not to Python, so only what can go wrong inside any graph applies to it."""
    def doubled(tokens):
        return tokens * 2

    def counted(tokens):
        return tokens + tokens.nonzero().sum()

    def branching(branch):
        def step(state):
            state.lengths.add_(torch.cond(state.tokens.sum() > 3, branch, lambda tokens: tokens - 1, (state.tokens,)))
        return step

    compiled, manager = compile_toy(branching(doubled))
    state = toy_state()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled(state)
    assert state.lengths.tolist() == [0, 2, 4, 6]
    assert manager.graphs_seen == ["toy"] and manager.context.last_written == ["lengths"]

    compiled, _ = compile_toy(branching(counted))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), \
            torch._inductor.config.patch(fx_graph_cache=False), pytest.raises(Exception) as info:
        compiled(toy_state())
    assert "toy (a branch): host sync" in audit_failure(info.value)


def test_uuid_covers_the_pass_configuration():
    def uuid(writes):
        return SpecPassManager(default_passes(), PassContext("g", writes)).uuid()

    assert uuid(("a",)) == uuid(("a",))
    assert uuid(("a",)) != uuid(("a", "b"))


def faulty_engine(path, mode: GraphMode, passes):
    llm = LLM(path, graph_mode=mode, warm_up=False, **ENGINE)
    engine = llm.engine
    engine.runner = PositionsInPythonRunner(llm.model, engine.state, engine.constants, mode,
                                            engine.runner.step_drafts, passes=passes)
    return llm


def test_audit_rejects_positions_advanced_in_python(tiny_checkpoint):
    llm = faulty_engine(tiny_checkpoint("predictive").path, GraphMode.FULL, passes=None)
    with pytest.raises(Exception) as info:
        llm.engine.startup.warm_up(show_progress=False)
    message = audit_failure(info.value)
    assert "returns tensors to Python" in message
    assert "decode state updated outside the graph: seq_lens" in message


@pytest.mark.slow
def test_without_the_audit_the_fault_collapses_acceptance_in_full_mode(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 90, (n,), generator=generator).tolist() for n in (4, 9, 13, 6)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    reference = LLM(path, graph_mode="eager", **ENGINE).generate(prompts, params)
    eager_faulty = faulty_engine(path, GraphMode.EAGER, passes=None).generate(prompts, params)
    full_llm = faulty_engine(path, GraphMode.FULL, passes=[])
    full_llm.engine.startup.warm_up(show_progress=False)
    full_faulty = full_llm.generate(prompts, params)

    def accepted(outputs):
        return sum(o.stats.accepted for o in outputs) / sum(o.stats.steps for o in outputs)

    # Eager reads the rebound tensor, so the fault is harmless there ...
    assert [o.token_ids for o in eager_faulty] == [o.token_ids for o in reference]
    assert accepted(reference) > 0.5
    # ... but the captured graph keeps reading its own buffer: drafts are verified at stale positions,
    # the output is wrong and acceptance collapses (to about half here).
    assert [o.token_ids for o in full_faulty] != [o.token_ids for o in reference]
    assert accepted(full_faulty) < 0.75 * accepted(reference)
