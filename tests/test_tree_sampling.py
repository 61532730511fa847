"""Token trees stay lossless when sampling: with a tree the sampled tokens have the target model's distribution.

The same six-token model and chi-square tests as test_sampling_lossless.py, with the tree (3, 2): at depth 1 the
chain's draft and two more candidates, at depth 2 the draft and one more. A six-token vocabulary makes the leaves
matter, so a wrong multi-candidate rule moves the distribution far enough to fail the test.
"""

import numpy as np
import pytest

import compiled_spec.speculative.tree as tree_module
from test_sampling_lossless import (  # noqa: F401 (vocab_checkpoint: a fixture)
    BAD_P, GOOD_P, NUM_REQUESTS, SETTINGS, exact_joint, p_values, sample, vocab_checkpoint)

TREE = (3, 2)


def sample_tree(path, settings: dict, seed_offset: int, tree=TREE, num_requests: int = NUM_REQUESTS):
    return sample(path, None, settings, seed_offset, num_requests, draft_tree=tree)


def tokens_per_step(outputs) -> float:
    return np.mean([o.stats.mean_accepted_length for o in outputs])


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tree_samples_have_the_target_distribution(vocab_checkpoint, setting):
    settings = SETTINGS[setting]
    joint = exact_joint(vocab_checkpoint.model, settings)
    tokens, outputs = sample_tree(vocab_checkpoint.path, settings, seed_offset=NUM_REQUESTS)
    assert min(p_values(tokens, joint).values()) > GOOD_P, p_values(tokens, joint)
    # The leaves are used: the same requests as a chain of the same depth accept more per step.
    _, chain = sample_tree(vocab_checkpoint.path, settings, seed_offset=NUM_REQUESTS, tree=(1, 1))
    assert tokens_per_step(outputs) > tokens_per_step(chain) + 0.1, (tokens_per_step(outputs), tokens_per_step(chain))


def _keep_target_after_rejection(p, q, token, rejected):
    """Wrong: after a rejection the next candidate is tested against p and the original q, and the token drawn after
    the last rejection comes from p, not from the residual."""
    return p, q


def _residual_without_renormalized_q(p, q, token, rejected):
    """Wrong: p becomes the residual, but q keeps the rejected candidate's mass (sampling with replacement's q)."""
    residual, _ = _real_after_rejection(p, q, token, rejected)
    return residual, q


_real_after_rejection = tree_module._after_rejection


@pytest.mark.parametrize("wrong_rule,num_requests",
                         [(_keep_target_after_rejection, NUM_REQUESTS), (_residual_without_renormalized_q, 4000)],
                         ids=["keep_target", "q_not_renormalized"])  # the second is a subtler error
def test_wrong_multi_candidate_rules_fail_the_same_test(vocab_checkpoint, monkeypatch, wrong_rule, num_requests):
    monkeypatch.setattr(tree_module, "_after_rejection", wrong_rule)
    joint = exact_joint(vocab_checkpoint.model, SETTINGS["t1"])
    tokens, _ = sample_tree(vocab_checkpoint.path, SETTINGS["t1"], seed_offset=NUM_REQUESTS, num_requests=num_requests)
    assert min(p_values(tokens, joint).values()) < BAD_P, p_values(tokens, joint)
