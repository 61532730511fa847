"""On a CUDA machine: real cudagraph-tree replay keeps acceptance and outputs equal to eager.

Run on a GPU box with `python -m pytest -q -m cuda tests/test_cuda_graphs.py`; skipped without one.
Every graph must really be replayed as a CUDA graph (cudagraph_or_error), and nothing recompiles
after warm-up.
"""

from __future__ import annotations

import pytest
import torch

from compiled_spec import LLM, SamplingParams

pytestmark = pytest.mark.cuda

K = 2
ENGINE = dict(num_speculative_tokens=K, max_batch_size=4, max_seq_len=64, batch_buckets=(2, 4), prefill_buckets=(64,))
PROMPT_LENGTHS = [3, 17, 5, 9, 30, 1, 12, 7, 22, 4, 15, 2, 26, 8, 11, 6, 19, 13]


def run(llm, prompts):
    llm.engine.step_log.clear()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    return [o.token_ids for o in outputs], list(llm.engine.step_log)


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_cudagraph_replay_keeps_acceptance_parity(tiny_checkpoint, mode):
    checkpoint = tiny_checkpoint("predictive")
    generator = torch.Generator().manual_seed(0)
    vocab = checkpoint.model.config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    eager = run(LLM(checkpoint.path, graph_mode="eager", device="cuda", **ENGINE), prompts)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        llm = LLM(checkpoint.path, graph_mode=mode, device="cuda", show_progress=False, **ENGINE)
        with torch.compiler.set_stance("fail_on_recompile"):
            replayed = run(llm, prompts)
    accepted = {count for step in eager[1] for _, count in step}
    assert {0, 1, K} <= accepted
    assert replayed == eager
