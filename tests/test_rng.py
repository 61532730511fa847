"""The counter-based RNG: uniform, independent across positions, seeds, purposes and lanes; 64-bit seeds work."""

import numpy as np
import pytest
import torch
from scipy import stats

from compiled_spec.speculative import rng
from compiled_spec.speculative.sampler import race_sample

ALPHA = 1e-4  # the streams are fixed, so these tests are deterministic; a good RNG passes with a wide margin


def uniforms_at(seeds, positions, purpose=rng.TARGET, count=1):
    key = rng.stream_key(torch.as_tensor(seeds, dtype=torch.int64), torch.as_tensor(positions, dtype=torch.int64), purpose)
    return rng.uniforms(key, count)


def pair_independence_pvalue(a: torch.Tensor, b: torch.Tensor, bins: int = 10) -> float:
    """Chi-square test that (a, b) is uniform on the unit square (uniform and independent)."""
    cells = (a * bins).long().clamp(max=bins - 1) * bins + (b * bins).long().clamp(max=bins - 1)
    counts = torch.bincount(cells, minlength=bins * bins).numpy()
    return stats.chisquare(counts).pvalue


def test_uniforms_are_uniform():
    seeds = torch.arange(200).repeat_interleave(100)
    positions = torch.arange(100).repeat(200)
    u = uniforms_at(seeds, positions, count=8).flatten()
    assert u.dtype == torch.float32
    assert 0 < u.min().item() and u.max().item() < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > ALPHA
    counts = torch.bincount((u * 50).long(), minlength=50).numpy()
    assert stats.chisquare(counts).pvalue > ALPHA
    assert abs(u.mean().item() - 0.5) < 0.005


def test_unit_floats_stay_strictly_inside_zero_and_one():
    extremes = rng.to_unit(torch.tensor([0, 1 << 9, rng.MASK32 - (1 << 9), rng.MASK32]))
    assert extremes.dtype == torch.float32
    assert 0 < extremes.min().item() and extremes.max().item() < 1
    assert extremes.unique().numel() == 4


def test_one_hot_distributions_always_sample_their_token():
    """Greedy rows sample one-hot distributions by the race; a uniform of exactly 1 anywhere in a row
    used to turn a zero-probability lane into NaN, which argmax picked (about once per 4096 draws)."""
    vocab, hot = 4096, 17
    probs = torch.zeros(vocab)
    probs[hot] = 1.0
    for chunk in range(10):
        keys = rng.stream_key(torch.arange(2000) + 2000 * chunk, torch.full((2000,), 5), rng.TARGET)
        assert (race_sample(probs.expand(2000, vocab), keys) == hot).all()


def test_independent_across_positions():
    positions = torch.arange(20_001)
    u = uniforms_at(torch.full_like(positions, 1234), positions)[:, 0]
    assert pair_independence_pvalue(u[:-1], u[1:]) > ALPHA
    assert abs(np.corrcoef(u[:-1].numpy(), u[1:].numpy())[0, 1]) < 0.03


@pytest.mark.parametrize("seed_step", [1, 2**32, 2**40 + 1])
def test_independent_across_seeds(seed_step):
    seeds = torch.arange(20_000) * seed_step
    a = uniforms_at(seeds, torch.full_like(seeds, 7))[:, 0]
    b = uniforms_at(seeds + seed_step, torch.full_like(seeds, 7))[:, 0]
    assert pair_independence_pvalue(a, b) > ALPHA
    assert stats.kstest(a.numpy(), "uniform").pvalue > ALPHA


def test_independent_across_purposes_and_lanes():
    seeds = torch.arange(20_000)
    positions = torch.full_like(seeds, 3)
    target = uniforms_at(seeds, positions, rng.TARGET, count=2)
    accept = uniforms_at(seeds, positions, rng.ACCEPT)[:, 0]
    draft = uniforms_at(seeds, positions, rng.DRAFT + 1)[:, 0]
    assert pair_independence_pvalue(target[:, 0], accept) > ALPHA
    assert pair_independence_pvalue(accept, draft) > ALPHA
    assert pair_independence_pvalue(target[:, 0], target[:, 1]) > ALPHA


def test_large_seeds_use_all_64_bits_without_overflow():
    seeds = torch.tensor([0, 5, 2**32, 2**32 + 5, 2**40 + 5, 2**62 + 5, 2**63 - 1], dtype=torch.int64)
    positions = torch.tensor([0, 1, 2**20, 2**27, 0, 3, 2**27 - 1])
    for purpose in (rng.TARGET, rng.ACCEPT, rng.DRAFT + 8):
        keys = rng.stream_key(seeds, positions, purpose)
        assert keys.dtype == torch.int64
        assert (keys >= 0).all() and (keys < 2**32).all()
        u = rng.uniforms(keys, 16)
        assert torch.isfinite(u).all() and (u > 0).all() and (u < 1).all()
    same_position = torch.zeros_like(seeds)
    keys = rng.stream_key(seeds, same_position, rng.TARGET)
    assert len(set(keys.tolist())) == len(seeds), "seeds that differ only in high bits must give other streams"
    assert torch.equal(keys, rng.stream_key(seeds.clone(), same_position, rng.TARGET))  # reproducible


def test_race_sampling_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 40_000
    keys = rng.stream_key(torch.arange(n) + 2**35, torch.full((n,), 11), rng.TARGET)
    tokens = race_sample(probs.expand(n, -1), keys)
    counts = torch.bincount(tokens, minlength=6).numpy()
    assert counts[5] == 0
    assert stats.chisquare(counts[:5], probs[:5].numpy() * n).pvalue > ALPHA


def test_large_seeds_end_to_end(tiny_checkpoint):
    from compiled_spec.api import LLM
    from compiled_spec.params import SamplingParams

    llm = LLM(tiny_checkpoint("predictive").path, num_speculative_tokens=2, max_seq_len=40, max_batch_size=4)
    seeds = [5, 5 + 2**32, 2**62 + 5, 2**63 - 1]
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=seed, ignore_eos=True) for seed in seeds]
    first = [o.token_ids for o in llm.generate([[3, 4]] * len(seeds), params)]
    second = [o.token_ids for o in llm.generate([[3, 4]] * len(seeds), params)]
    assert first == second
    assert len({tuple(tokens) for tokens in first}) == len(seeds)
