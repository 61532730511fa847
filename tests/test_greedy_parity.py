"""Greedy speculative decoding is lossless: every k gives k=0's tokens, which are transformers' greedy tokens."""

import pytest
import torch

from compiled_spec.api import LLM
from compiled_spec.params import SamplingParams

# Mixed lengths; more prompts than max_batch_size, and different max_tokens, so requests are admitted
# into freed slots while others are mid-decode.
PROMPTS = [[5, 9, 2], [70], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [20, 21, 22, 23, 24, 25, 26], [88, 7], [60, 61, 62, 63, 64]]
MAX_TOKENS = [14, 9, 16, 12, 15, 11]
MAX_BATCH = 4
MAX_SEQ_LEN = 32


def engine_greedy(path, k, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    llm = LLM(path, num_speculative_tokens=k, max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH)
    params = [SamplingParams(max_tokens=n) for n in max_tokens]
    return llm, llm.generate(prompts, params)


@torch.no_grad()
def transformers_greedy(model, prompt, max_tokens):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=model.config.eos_token_id
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["predictive", "predictive_moe", "llama", "qwen3"])
def test_greedy_equals_transformers_for_every_k(tiny_checkpoint, name):
    checkpoint = tiny_checkpoint(name)
    expected = [transformers_greedy(checkpoint.model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    eos = checkpoint.model.config.eos_token_id
    for k in (0, 1, 2, 3):
        llm, outputs = engine_greedy(checkpoint.path, k)
        for output, want, limit in zip(outputs, expected, MAX_TOKENS):
            assert output.token_ids == want, (name, k)
            assert output.finish_reason == ("stop" if want[-1] == eos and len(want) <= limit else "length")
        if k > 0:
            steps = [accepted for lanes in llm.engine.step_log for _, accepted in lanes]
            assert sum(o.stats.steps for o in outputs) == len(steps)
            if name.startswith("predictive"):
                # Steps that accepted none, some and all drafts were all exercised.
                assert {0, k} <= set(steps) and (k == 1 or set(range(1, k)) & set(steps)), steps


def test_request_alone_equals_request_in_a_batch(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    _, batched = engine_greedy(path, 3)
    for index in (0, 2, 5):
        _, (alone,) = engine_greedy(path, 3, [PROMPTS[index]], [MAX_TOKENS[index]])
        assert alone.token_ids == batched[index].token_ids


def test_seeded_sampled_request_alone_equals_request_in_a_batch(tiny_checkpoint):
    """Sampling is keyed by (seed, position): a request's tokens do not depend on its neighbours."""
    path = tiny_checkpoint("predictive").path
    llm = LLM(path, num_speculative_tokens=3, max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH)
    params = [
        SamplingParams(max_tokens=n, temperature=(0.0 if i % 3 == 0 else 1.0), top_k=(5 if i == 4 else 0), seed=100 + i)
        for i, n in enumerate(MAX_TOKENS)
    ]
    batched = llm.generate(PROMPTS, params)
    for prompt, param, output in zip(PROMPTS, params, batched):
        (alone,) = llm.generate([prompt], param)
        assert alone.token_ids == output.token_ids
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in batched]
