"""Injected faults of the bug class the engine exists to prevent: decode state updated outside the graph."""

from __future__ import annotations

import dataclasses
from dataclasses import fields

import torch

from compiled_spec.compiler.step_runner import StepRunner
from compiled_spec.passes.graph_inputs import state_field
from compiled_spec.speculative.state import DecodeState
from compiled_spec.speculative.step import speculative_step


def step_with_positions_in_python(model, state, constants, batch_size, k, tree=False):
    """The real step, except that the advanced lengths are handed back instead of written into seq_lens."""
    scratch = DecodeState(**{f.name: getattr(state, f.name) for f in fields(state)})
    scratch.seq_lens = state.seq_lens.clone()
    speculative_step(model, scratch, constants, batch_size, k, tree)
    return scratch.seq_lens


def prefilling_in_eager(runner: StepRunner) -> StepRunner:
    """The runner, prefilling in eager over the buffers its prefill graph would capture (as a prompt longer than
    every bucket does). For a fault in the step, a prefill graph would add a compile and test nothing."""
    runner.compiles_prefill = False
    runner._prefills = {k: runner._eager_prefill for k in runner._prefills}
    return runner


class PositionsInPythonRunner(StepRunner):
    """A runtime that advances positions in Python after each call (it rebinds state.seq_lens).

    Eager code reads the new tensor; a captured graph keeps reading the buffer it was captured with.
    """

    def __init__(self, model, state, constants, mode, step_drafts, passes=None):
        super().__init__(model, state, constants, mode, step_drafts, passes=passes,
                         step_function=step_with_positions_in_python)
        prefilling_in_eager(self)  # the fault is in the step

    def step(self, batch_size: int, drafts):
        self.state.seq_lens = super().step(batch_size, drafts).clone()


def without_draft_mirror(config):
    """HiSparse with the draft-layer mirror skipped: the MTP layers' new KV rows stay in their hot buffers and
    never reach the cold pool (in vLLM the draft layer wrote after the per-step host mirror had run), so a
    row evicted and later swapped back in comes from a stale cold pool."""
    return dataclasses.replace(config, draft_mirror=False)


def step_without_draft_counts(model, state, constants, batch_size, k, tree=False):
    """The real step, except that the per-slot count of valid drafts is written into a copy: after a step that
    drafted fewer than K, the slots past its drafts still count as valid, so stale drafts get verified."""
    scratch = DecodeState(**{f.name: getattr(state, f.name) for f in fields(state)})
    scratch.draft_counts = state.draft_counts.clone()
    speculative_step(model, scratch, constants, batch_size, k, tree)


class ScaledStateWrite:
    """A compiled graph whose write of one decode-state field is multiplied by a factor (a miscompiled write):
    draft_probs halved; draft_tokens times 0, all token 0, with the probabilities of the drafts it should have made
    (greedy lanes reject them, so acceptance collapses; sampled lanes accept wrong tokens)."""

    name = "scaled_state_write"

    def __init__(self, field: str, factor: float):
        self.field, self.factor = field, factor

    def cache_key(self) -> str:
        return f"{self.field} * {self.factor}"

    def __call__(self, graph: torch.fx.Graph, context) -> list[str]:
        for node in graph.nodes:
            if node.target is torch.ops.aten.copy_.default and state_field(node.args[0]) == self.field:
                with graph.inserting_before(node):
                    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node.args[1], self.factor))
                node.args = (node.args[0], scaled)
                return []
        return [f"no {self.field} write"]
