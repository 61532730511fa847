"""piecewise on CPU runs the graph-partition code CUDA captures, and equals eager.

Inductor makes partition functions for CUDA graphs only; piecewise on CPU makes them too (compiler/cpu_partitions.py),
running each uncaptured, so a value lost between two partitions (a cat whose slices two partitions write into copies
of their own: on CUDA, garbage drafts and an index out of bounds) shows here. K=3 drafts, so the drafts, their
probabilities and the carried hidden states of depths 1..3 are each assembled from values computed after three
different attention calls. Greedy and seeded requests run in one batch.
"""

from __future__ import annotations

import pytest
import torch

from compiled_spec import LLM, HiSparseConfig, SamplingParams
from compiled_spec.compiler import cpu_partitions

# One worker builds each engine pair once for both tests (with -n 2, split tests would build it on each worker).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("partition_engines")]

ENGINE = dict(num_speculative_tokens=3, max_batch_size=2, max_seq_len=64, batch_buckets=(2,), prefill_buckets=(16,))
# k=3: a pass writes up to 6 rows and reads 4 per query, so every step evicts.
SATURATED = HiSparseConfig(top_k_tokens=4, hot_rows=10)
PROMPT_LENGTHS = (3, 11, 6, 14, 2, 9)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7)


def run(llm: LLM, prompts):
    llm.engine.step_log.clear()
    params = [GREEDY if i % 2 == 0 else SEEDED for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    return [o.token_ids for o in outputs], list(llm.engine.step_log)


@pytest.fixture(scope="module", params=[None, SATURATED], ids=["dense", "hisparse_saturated"])
def runs(request, tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 96, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    eager = run(LLM(path, graph_mode="eager", hisparse=request.param, **ENGINE), prompts)
    graphs_before = len(cpu_partitions.partitions_per_graph)
    llm = LLM(path, graph_mode="piecewise", hisparse=request.param, show_progress=False, **ENGINE)
    partitions = cpu_partitions.partitions_per_graph[graphs_before:]
    with torch.compiler.set_stance("fail_on_recompile"):
        piecewise = run(llm, prompts)
    return eager, piecewise, partitions


def test_piecewise_on_cpu_runs_partition_functions(runs):
    _, _, partitions = runs
    # The step and the prefill graph, each split at 1 main + 3 draft attention calls (the step's draft-extend too).
    assert len(partitions) == 2 and all(count >= 4 for count in partitions), partitions


def test_partitioned_piecewise_equals_eager_in_tokens_and_acceptance(runs):
    (eager_tokens, eager_steps), (tokens, steps), _ = runs
    accepted = [count for step in eager_steps for _, count in step]
    assert {0, 3} <= set(accepted)  # steps that accept none and all of their drafts
    assert tokens == eager_tokens
    assert steps == eager_steps
