"""Token trees: greedy output equals plain decoding's, also with HiSparse, and with HiSparse full equals eager in tokens
and in every step's accepted path, with no recompile. Without HiSparse the tree runs in every graph mode in
test_parity_matrix.py.

The workload of test_graph_modes.py (more requests than slots, mixed prompt lengths, prompts past the prefill
bucket) with the tree (2, 2). The tokens, accepted count and leaf flag of each step fix the path it took (a chain
node or a leaf at its last depth). Compiling the step runs the graph passes, so the state-mutation audit checks the
tree step's writes (draft_leaves, the leaf's rows moved in the main caches, step_on_leaf) too.
"""

from __future__ import annotations

import pytest
import torch

from compiled_spec import LLM, HiSparseConfig
from compiled_spec.compiler.step_runner import graphs_made
from faults import prefilling_in_eager
from test_auto_k import record_steps
from test_graph_modes import run_workload, workload  # noqa: F401 (a fixture)
from test_hisparse import fused_op_calls

TREE = (2, 2)
ENGINE = dict(max_batch_size=4, max_seq_len=64, batch_buckets=(4,), prefill_buckets=(16,))
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tree_engines")]


def run_tree_workload(llm: LLM, prompts):
    """The tokens, every step's (request, accepted) lanes, and every step's per-lane flag: the path ended on a leaf."""
    records = record_steps(llm)
    tokens, steps = run_workload(llm, prompts)
    return tokens, steps, [record.on_leaf for record in records]


def leaf_ends(result) -> int:
    """Lanes whose path ended on a leaf, over every step."""
    return sum(sum(flags) for flags in result[2])


@pytest.fixture(scope="module")
def eager_result(workload):
    path, prompts = workload
    return run_tree_workload(LLM(path, graph_mode="eager", draft_tree=TREE, **ENGINE), prompts)


def test_greedy_tree_output_equals_plain_decoding_and_the_leaves_are_used(workload, eager_result):
    path, prompts = workload
    plain_tokens, _ = run_workload(LLM(path, graph_mode="eager", num_speculative_tokens=0, **ENGINE), prompts)
    chain_tokens, chain_steps = run_workload(LLM(path, graph_mode="eager", num_speculative_tokens=len(TREE),
                                                 **ENGINE), prompts)
    tree_tokens, tree_steps, _ = eager_result
    assert tree_tokens == plain_tokens == chain_tokens
    # The same tokens in fewer steps: some paths ended on a leaf where the chain's draft was rejected.
    assert len(tree_steps) < len(chain_steps), (len(tree_steps), len(chain_steps))
    assert leaf_ends(eager_result) > 0


# --- with HiSparse ---------------------------------------------------------------------------------------------

# Each query reads 4 past tokens; the hot buffer's 16 rows hold fewer than a request's 20-50 positions, so steps evict
# and swap rows in from the cold pool, and a rejected draft's hot row often outlives the step that accepted a leaf in
# its place (the test below fails if the leaf's hot row or its index key is not moved).
SPARSE = HiSparseConfig(top_k_tokens=4, hot_rows=16)


@pytest.fixture(scope="module")
def sparse_eager_result(workload):
    path, prompts = workload
    return run_tree_workload(LLM(path, graph_mode="eager", draft_tree=TREE, hisparse=SPARSE, **ENGINE), prompts)


def test_with_hisparse_greedy_tree_output_equals_plain_decoding_and_the_leaves_are_used(workload, sparse_eager_result):
    path, prompts = workload
    plain_tokens, _ = run_workload(LLM(path, graph_mode="eager", num_speculative_tokens=0, hisparse=SPARSE, **ENGINE),
                                   prompts)
    chain_tokens, chain_steps = run_workload(LLM(path, graph_mode="eager", num_speculative_tokens=len(TREE),
                                                 hisparse=SPARSE, **ENGINE), prompts)
    dense_tokens, _ = run_workload(LLM(path, graph_mode="eager", num_speculative_tokens=0, **ENGINE), prompts)
    tree_tokens, tree_steps, _ = sparse_eager_result
    assert tree_tokens == plain_tokens == chain_tokens
    assert tree_tokens != dense_tokens  # four past tokens per query do change the text
    assert len(tree_steps) < len(chain_steps), (len(tree_steps), len(chain_steps))
    assert leaf_ends(sparse_eager_result) > 0


def test_with_hisparse_full_equals_eager_without_recompiles(workload, sparse_eager_result):
    path, prompts = workload
    # Only the step differs from a chain's with HiSparse (whose prefill graph test_hisparse compiles) and from the
    # dense tree's (the test above): prefill in eager, and compile the step alone.
    llm = LLM(path, graph_mode="full", draft_tree=TREE, hisparse=SPARSE, warm_up=False, **ENGINE)
    prefilling_in_eager(llm.engine.runner)
    llm.engine.startup.warm_up(show_progress=False)
    warm_up_graphs = graphs_made(llm.engine.runner)
    with torch.compiler.set_stance("fail_on_recompile"):
        result, calls = fused_op_calls(lambda: run_tree_workload(llm, prompts))
    assert result == sparse_eager_result
    assert calls == 3 * len(result[1])  # the fused sparse attention: the main layer and both draft depths, every step
    assert warm_up_graphs > 0 and graphs_made(llm.engine.runner) == warm_up_graphs
