"""Sampling on packed weights in a compiled mode has the target distribution: a tiny Q4_1 GGUF, kept packed and
decoded under `compile`, against the exact distribution of its first two tokens from the same file dequantized
(an independent path: float weights, no packed kernel). The first token comes from the compiled prefill, the second
from the compiled decode step."""

import numpy as np
import pytest
import torch

from compiled_spec import LLM, SamplingParams
from test_sampling_lossless import GOOD_P, goodness_of_fit, truncated_probs
from tiny_gguf import write_gguf

pytestmark = pytest.mark.slow

NUM_REQUESTS = 1024
BATCH = 64
SETTINGS = dict(temperature=1.0, top_k=6)  # 36 (t1, t2) cells, about 28 samples each


@torch.no_grad()
def exact_first_two(reference: LLM, prompt: list[int]) -> np.ndarray:
    """P(t1, t2 | prompt) as a [V, V] array, from the dequantized model's logits."""
    first = truncated_probs(reference.logits(prompt)[-1].double(), **SETTINGS)
    joint = torch.zeros(first.numel(), first.numel(), dtype=torch.float64)
    for token in first.nonzero().flatten().tolist():
        joint[token] = first[token] * truncated_probs(reference.logits(prompt + [token])[-1].double(), **SETTINGS)
    return joint.numpy()


def test_packed_compiled_samples_have_the_dequantized_models_distribution(tmp_path):
    path, _ = write_gguf(tmp_path, "llama", "Q4_1", tie_word_embeddings=True)
    reference = LLM(path, dequantize=True, graph_mode="eager", num_speculative_tokens=0, max_seq_len=16,
                    max_batch_size=1, show_progress=False)
    prompt = reference.encode("ROMEO: But")
    joint = exact_first_two(reference, prompt)
    llm = LLM(path, graph_mode="compile", num_speculative_tokens=0, max_seq_len=16, max_batch_size=BATCH,
              batch_buckets=(BATCH,), prefill_buckets=(16,), show_progress=False)
    assert llm.weight_format == "Q4_1 packed"
    params = [SamplingParams(max_tokens=2, ignore_eos=True, seed=seed, **SETTINGS) for seed in range(NUM_REQUESTS)]
    tokens = np.array([output.token_ids for output in llm.generate([prompt] * NUM_REQUESTS, params)])
    assert tokens.shape == (NUM_REQUESTS, 2)
    p_values = {"t1": goodness_of_fit(tokens[:, :1], joint.sum(1)), "t1 t2": goodness_of_fit(tokens, joint)}
    assert min(p_values.values()) > GOOD_P, p_values
