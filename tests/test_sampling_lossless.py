"""Speculative sampling is lossless: with k=2 the sampled tokens have the target model's distribution.

A six-token vocabulary keeps the joint distribution of the first three generated tokens (216 cells)
dense enough for a chi-square test over a thousand seeded requests. The first token comes from
prefill; the second and third come from verification (accepted drafts, residual and bonus tokens),
so their joint with the first is what rejection sampling must get right. The exact distribution is
computed from the transformers model. Samplers that break the rule must fail the same test.
"""

import numpy as np
import pytest
import torch
from scipy import stats

import compiled_spec.speculative.step as step_module
from compiled_spec.api import LLM
from compiled_spec.params import SamplingParams
from compiled_spec.speculative import rng
from compiled_spec.speculative.sampler import race_sample

PROMPT = [4, 2, 3, 0]
NUM_REQUESTS = 1000
GENERATED = 3
GOOD_P = 1e-3  # seeds are fixed, so each p-value is a fixed number; the correct sampler clears this widely
BAD_P = 1e-8

SETTINGS = {"t1": dict(temperature=1.0), "truncated": dict(temperature=0.7, top_k=4, top_p=0.9)}


def truncated_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (keep the most likely tokens until their mass reaches top_p)."""
    probs = (logits / temperature).softmax(-1)
    order = probs.argsort(-1, descending=True)
    ranked = probs.gather(-1, order)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if top_k:
        keep[..., top_k:] = False
    ranked = torch.where(keep, ranked, 0.0)
    ranked = ranked / ranked.sum(-1, keepdim=True)
    keep &= (ranked.cumsum(-1) - ranked) < top_p
    ranked = torch.where(keep, ranked, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, ranked / ranked.sum(-1, keepdim=True))


@torch.no_grad()
def exact_joint(model, settings: dict) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) as a [V, V, V] array."""
    vocab = model.config.vocab_size
    sequences = torch.tensor([PROMPT + [a, b] for a in range(vocab) for b in range(vocab)])
    probs = truncated_probs(model(sequences).logits.double(), **settings)
    n = len(PROMPT)
    first = probs[0, n - 1]
    second = probs[::vocab, n]
    third = probs[:, n + 1].view(vocab, vocab, vocab)
    return (first[:, None, None] * second[:, :, None] * third).numpy()


def sample(path, k: int | None, settings: dict, seed_offset: int, num_requests: int = NUM_REQUESTS, **engine):
    """engine: more LLM arguments (draft_tree=...)."""
    llm = LLM(path, num_speculative_tokens=k, max_seq_len=8, max_batch_size=256, **engine)
    params = [
        SamplingParams(max_tokens=GENERATED, ignore_eos=True, seed=seed_offset + i, **settings)
        for i in range(num_requests)
    ]
    outputs = llm.generate([PROMPT] * num_requests, params)
    tokens = np.array([o.token_ids for o in outputs])
    assert tokens.shape == (num_requests, GENERATED)
    return tokens, outputs


def goodness_of_fit(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of sampled tuples against their exact distribution; cells expecting < 5 are pooled."""
    counts = np.bincount(np.ravel_multi_index(tuple(tokens.T), probs.shape), minlength=probs.size)
    expected = probs.flatten() * len(tokens)
    if counts[expected == 0].any():
        return 0.0  # a token the target can never produce
    large = expected >= 5
    observed, expected = counts[large], expected[large]
    pooled = probs.flatten()[~large].sum() * len(tokens)
    if pooled > 0:
        observed, expected = np.append(observed, counts[~large].sum()), np.append(expected, pooled)
    return stats.chisquare(observed, expected / expected.sum() * observed.sum()).pvalue


def p_values(tokens: np.ndarray, joint: np.ndarray) -> dict[str, float]:
    """Goodness of fit of (t1, t2, t3), (t1, t2) and (t2, t3)."""
    return {
        "t1 t2 t3": goodness_of_fit(tokens, joint),
        "t1 t2": goodness_of_fit(tokens[:, :2], joint.sum(2)),
        "t2 t3": goodness_of_fit(tokens[:, 1:], joint.sum(0)),
    }


@pytest.fixture(scope="module")
def vocab_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("tiny_vocab")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_k2_samples_have_the_target_distribution_as_k0_does(vocab_checkpoint, setting):
    settings = SETTINGS[setting]
    joint = exact_joint(vocab_checkpoint.model, settings)
    tokens, outputs = sample(vocab_checkpoint.path, 2, settings, seed_offset=NUM_REQUESTS)
    rates = np.mean([o.stats.acceptance_rate_per_position for o in outputs], axis=0)
    assert 0.1 < rates[0] < 0.9, rates  # drafts are both accepted and rejected
    assert min(p_values(tokens, joint).values()) > GOOD_P, p_values(tokens, joint)
    if setting != "t1":
        return
    plain, _ = sample(vocab_checkpoint.path, 0, settings, seed_offset=0)
    assert min(p_values(plain, joint).values()) > GOOD_P, p_values(plain, joint)
    # k=2 against k=0 directly (second and third tokens), without the exact distribution.
    speculative = tokens
    vocab = joint.shape[0]
    table = np.stack([np.bincount(t[:, 1] * vocab + t[:, 2], minlength=vocab**2) for t in (plain, speculative)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > GOOD_P


def _resample_from_target(target_probs, draft_probs, draft_tokens, seeds, first_position, draft_counts=None):
    """Wrong: after a rejection, draws from p instead of norm(max(p - q, 0))."""
    accepted, _ = _real_verify(target_probs, draft_probs, draft_tokens, seeds, first_position, draft_counts)
    return accepted, _draw_from_target(target_probs, accepted, seeds, first_position)


def _accept_every_draft(target_probs, draft_probs, draft_tokens, seeds, first_position, draft_counts=None):
    """Wrong: keeps every draft."""
    accepted = torch.full_like(seeds, draft_tokens.shape[1])
    return accepted, _draw_from_target(target_probs, accepted, seeds, first_position)


def _draw_from_target(target_probs, accepted, seeds, first_position):
    rows = torch.arange(len(accepted))
    return race_sample(target_probs[rows, accepted], rng.stream_key(seeds, first_position + accepted, rng.TARGET))


_real_verify = step_module.verify_drafts


@pytest.mark.parametrize(
    "wrong_sampler,num_requests",
    [(_resample_from_target, NUM_REQUESTS), (_accept_every_draft, 300)],  # the second is grossly wrong
    ids=["resample_from_target", "accept_every_draft"],
)
def test_wrong_samplers_fail_the_same_test(vocab_checkpoint, monkeypatch, wrong_sampler, num_requests):
    monkeypatch.setattr(step_module, "verify_drafts", wrong_sampler)
    joint = exact_joint(vocab_checkpoint.model, SETTINGS["t1"])
    tokens, _ = sample(vocab_checkpoint.path, 2, SETTINGS["t1"], NUM_REQUESTS, num_requests)
    assert min(p_values(tokens, joint).values()) < BAD_P
