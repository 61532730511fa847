"""n-gram drafts (speculative/ngram.py): what they propose, that speculating with them is lossless, and how a user
chooses them. Every compiled mode against eager, with n-gram drafts, is in test_parity_matrix.py."""

import random

import numpy as np
import pytest
import torch

import compiled_spec.speculative.ngram as ngram
from compiled_spec import LLM, CompiledSpecError, SamplingParams
from test_sampling_lossless import (  # noqa: F401 (vocab_checkpoint: a fixture)
    BAD_P, GOOD_P, NUM_REQUESTS, SETTINGS, exact_joint, p_values, sample, vocab_checkpoint)


def lookup(tokens: list[int], k: int, sizes=ngram.SIZES) -> list[int]:
    """Prompt lookup as a loop: for the longest suffix of `tokens` (of one of `sizes`) that occurs earlier, the
    latest occurrence with k tokens after it, else the latest; the (up to k) tokens after it."""
    last = len(tokens) - 1
    for size in sorted(sizes, reverse=True):
        if size > len(tokens):
            continue
        suffix = tokens[len(tokens) - size:]
        ends = [end for end in range(size - 1, last) if tokens[end - size + 1: end + 1] == suffix]
        if ends:
            end = max([e for e in ends if e + k <= last] or ends)
            return tokens[end + 1: min(end + 1 + k, last + 1)]
    return []


def test_proposals_equal_a_plain_lookup():
    rng = random.Random(0)
    k, width, histories, lengths = 4, 40, [], []
    for _ in range(300):
        length = rng.randint(1, width - 1)
        alphabet = rng.randint(2, 12)  # small alphabets repeat n-grams often, large ones rarely
        tokens = [rng.randrange(alphabet) for _ in range(length)]
        histories.append(tokens + [rng.randrange(50) for _ in range(width - length)])  # stale tokens past the end
        lengths.append(length)
    drafts, counts = ngram.propose(torch.tensor(histories), torch.tensor(lengths), k)
    got = [row[:count] for row, count in zip(drafts.tolist(), counts.tolist())]
    want = [lookup(tokens[:length], k) for tokens, length in zip(histories, lengths)]
    assert got == want
    assert sum(map(bool, want)) > 100 and sum(not w for w in want) > 10  # rows with and without a match
    assert any(0 < len(w) < k for w in want)  # a match near the end proposes fewer than k
    assert all(row[count:] == [0] * (k - count) for row, count in zip(drafts.tolist(), counts.tolist()))


COMPILED = dict(drafter="ngram", graph_mode="compile", batch_buckets=(256,), prefill_buckets=(8,))


@pytest.mark.slow
def test_ngram_samples_have_the_target_distribution(vocab_checkpoint):
    """q is one-hot: a draft x is accepted with probability p(x), and after a rejection the token comes from p without
    x. The prompt's tokens recur in the six-token vocabulary, so most steps draft from a match. Temperature with top-k
    and top-p (the sampler's whole path; temperature 1 alone is the wrong rule's test below)."""
    settings = SETTINGS["truncated"]
    joint = exact_joint(vocab_checkpoint.model, settings)
    tokens, outputs = sample(vocab_checkpoint.path, 2, settings, seed_offset=NUM_REQUESTS, **COMPILED)
    rates = np.mean([o.stats.acceptance_rate_per_position for o in outputs], axis=0)
    assert 0.1 < rates[0] < 0.9, rates  # drafts are both accepted and rejected
    assert min(p_values(tokens, joint).values()) > GOOD_P, p_values(tokens, joint)


def _no_draft_mass(tokens, vocab_size):
    """Wrong: q(x) = 0, so the draft is accepted whenever the target can produce it (probability 1, not p(x)), and a
    rejection draws from p itself."""
    return torch.zeros(*tokens.shape, vocab_size)


def test_accepting_ngram_drafts_outright_fails_the_same_test(vocab_checkpoint, monkeypatch):
    monkeypatch.setattr(ngram, "draft_distribution", _no_draft_mass)
    joint = exact_joint(vocab_checkpoint.model, SETTINGS["t1"])
    tokens, _ = sample(vocab_checkpoint.path, 2, SETTINGS["t1"], NUM_REQUESTS, drafter="ngram")
    assert min(p_values(tokens, joint).values()) < BAD_P, p_values(tokens, joint)


def test_a_model_without_mtp_modules_drafts_ngrams_unless_told_otherwise(tiny_checkpoint):
    path = tiny_checkpoint("llama_no_mtp").path
    engine = dict(max_seq_len=64, max_batch_size=2, show_progress=False)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 4, 3, 4, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(path, **engine)
    assert (llm.config.drafter, llm.num_speculative_tokens) == ("ngram", 3)
    outputs = llm.generate(prompts, params)
    plain = LLM(path, num_speculative_tokens=0, **engine).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert outputs[0].stats.accepted_per_position[-1] > 0  # steps that accepted every draft
    with pytest.raises(CompiledSpecError, match="drafter='mtp' needs MTP weights.*use drafter='ngram'"):
        LLM(path, drafter="mtp", num_speculative_tokens=2, **engine)
    with pytest.raises(CompiledSpecError, match="drafter='eagle' is not a drafter; choose one of mtp, ngram"):
        LLM(path, drafter="eagle", **engine)
    with pytest.raises(CompiledSpecError, match="draft_tree='2,1' needs drafter='mtp'"):
        LLM(path, draft_tree="2,1", **engine)


def test_auto_at_k0_explores_and_learns_what_its_drafts_accept(tiny_checkpoint):
    """An estimate that fell to 0 (as a calibration request with no repeats leaves it) is moved by the steps that
    explore: the first drafts, the second verifies, on a prompt whose greedy output repeats."""
    llm = LLM(tiny_checkpoint("llama_no_mtp").path, num_speculative_tokens="auto", graph_mode="eager", max_seq_len=128,
              max_batch_size=1, show_progress=False)
    chooser = llm.engine.chooser
    chooser.explore_after, chooser.acceptance = 4, [0.0] * chooser.max_drafts
    output = llm.generate([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert output.stats.steps_per_num_drafts.get(0, 0) > 0 and output.stats.accepted > 0
    assert chooser.acceptance[0] > 0
