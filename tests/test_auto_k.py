"""k = auto: k changes between steps without changing the output or compiling anything, and a draft past a
slot's valid count is never accepted.

The chooser is replaced by a fixed schedule, so k switches in the middle of every request, down (a slot then
holds drafts from an older step past its count) and up (a lane verifies fewer drafts than the step's k).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.params import RequestOutput, SpecStats
from compiled_spec.config import GraphMode
from compiled_spec.engine.draft_chooser import DraftLengthChooser, LaneOutcome
from compiled_spec.compiler.step_runner import StepRunner
from compiled_spec.engine.request import Request
from compiled_spec.speculative.step import Drafts
from faults import step_without_draft_counts
from test_audit import audit_failure
from test_sampling_lossless import GOOD_P, PROMPT, exact_joint, goodness_of_fit

K = 2
SCHEDULE = [1, 2, 0, 2, 2, 1, 0, 0, 2, 1]
ENGINE = dict(num_speculative_tokens="auto", max_speculative_tokens=K, max_batch_size=4, max_seq_len=64,
              batch_buckets=(4,), prefill_buckets=(64,))
PROMPT_LENGTHS = [3, 17, 5, 9, 30, 1, 12, 7]


class ScheduledChooser(DraftLengthChooser):
    """Chooses from a fixed cycle of chains (k) and trees (Drafts(depth, tree=True)) instead of from estimates."""

    def __init__(self, schedule: list[int | Drafts], draft_tree: tuple[int, ...] | None = None):
        schedule = [Drafts(entry) if isinstance(entry, int) else entry for entry in schedule]
        super().__init__(max(drafts.k for drafts in schedule), draft_tree=draft_tree)
        self.schedule = itertools.cycle(schedule)

    def choose(self, bucket: int) -> Drafts:
        return next(self.schedule)


def scheduled(llm: LLM) -> LLM:
    llm.engine.chooser = ScheduledChooser(SCHEDULE)
    return llm


def record_steps(llm: LLM) -> list:
    """Every StepRecord the engine returns from now on."""
    records, step = [], llm.engine.step
    llm.engine.step = lambda on_tokens=None: records.append(step(on_tokens)) or records[-1]
    return records


@pytest.fixture(scope="session")
def prompts(tiny_checkpoint):
    checkpoint = tiny_checkpoint("predictive")
    generator = torch.Generator().manual_seed(1)
    vocab = checkpoint.model.config.vocab_size
    return checkpoint.path, [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="session")
def plain_tokens(prompts):
    path, texts = prompts
    llm = LLM(path, num_speculative_tokens=0, graph_mode="eager", **{k: v for k, v in ENGINE.items()
                                                                       if "speculative" not in k})
    return [o.token_ids for o in llm.generate(texts, GREEDY)]


@pytest.fixture(scope="session")
def eager_switching(prompts):
    path, texts = prompts
    llm = scheduled(LLM(path, graph_mode="eager", **ENGINE))
    records = record_steps(llm)
    outputs = llm.generate(texts, GREEDY)
    return outputs, records


def lane_counts(records) -> list[tuple[int, int, int]]:
    """(k of the step, drafts the lane verified, drafts it accepted) of every lane of every step."""
    return [(r.num_drafts, verified, accepted) for r in records for verified, (_, accepted) in zip(r.verified, r.lanes)]


def validly_held(records, k_before: int) -> list[tuple[int, int]]:
    """(drafts the lane validly held, drafts it accepted) of every lane of every step: a lane holds the k of the
    step before (its drafts, or its prefill's, were made then), at most the step's own k."""
    lanes, previous = [], k_before
    for record in records:
        lanes += [(min(record.num_drafts, previous), accepted) for _, accepted in record.lanes]
        previous = record.num_drafts
    return lanes


def test_switching_k_mid_request_keeps_greedy_output(plain_tokens, eager_switching):
    outputs, records = eager_switching
    assert [o.token_ids for o in outputs] == plain_tokens
    lanes = lane_counts(records)
    assert {k for k, _, _ in lanes} == {0, 1, 2}
    assert any(verified < k for k, verified, _ in lanes), "no lane verified fewer drafts than its step drafted"
    assert all(accepted <= verified for _, verified, accepted in lanes)
    assert [verified for _, verified, _ in lanes] == [held for held, _ in validly_held(records, K)]
    assert any(accepted == verified == 2 for _, verified, accepted in lanes)  # full acceptance happens too
    merged = [o.stats for o in outputs]
    assert sum(s.steps_per_num_drafts.get(0, 0) for s in merged) > 0
    for stats in merged:
        assert all(a <= v for a, v in zip(stats.accepted_per_position, stats.verified_per_position))


def test_a_step_drafting_k_runs_depths_up_to_k_only(prompts):
    """A step drafting k runs draft depths 1..k, as a K=k engine's step does: after k=1 steps, depth 1's KV rows
    over the verified tokens equal those of an engine that drafts K every step, and depth 2 has not written the
    rows those steps covered (they keep the zeros written before the request)."""
    path, texts = prompts
    prompt = texts[4]
    caches = []
    for schedule in ([1], [K]):
        llm = LLM(path, graph_mode="eager", **ENGINE)
        llm.engine.chooser = ScheduledChooser(schedule)
        for cache in llm.engine.state.draft_keys + llm.engine.state.draft_values:
            cache.zero_()  # warm-up's calibration request wrote rows in this slot
        records = record_steps(llm)
        llm.generate([prompt], GREEDY)
        assert {r.num_drafts for r in records[1:]} == set(schedule)
        state = llm.engine.state
        caches.append([torch.cat([keys[0], values[0]], -1) for keys, values in zip(state.draft_keys, state.draft_values)])
    verified_rows = len(prompt) + GREEDY.max_tokens - 1 - K  # every depth's row i reads up to token i + K
    (depth1_lean, depth2_lean), (depth1_full, depth2_full) = caches
    torch.testing.assert_close(depth1_lean[:verified_rows], depth1_full[:verified_rows], rtol=1e-4, atol=1e-4)
    decoded = slice(len(prompt), verified_rows)  # rows past the prompt: prefill wrote every depth before them
    assert depth2_full[decoded].abs().amax(-1).min() > 0
    assert depth2_lean[decoded].abs().max() == 0


def test_a_request_is_admitted_with_the_k_auto_decodes_with(prompts, plain_tokens):
    """Holding k=1, auto prefills with one draft: depth 1 writes the prompt's rows, depth 2 none at all."""
    path, texts = prompts
    llm = LLM(path, graph_mode="eager", **ENGINE)
    llm.engine.chooser = ScheduledChooser([1])
    llm.generate([texts[0]], SamplingParams(max_tokens=3, ignore_eos=True))  # the last step now drafted 1
    state = llm.engine.state
    for cache in state.draft_keys + state.draft_values:
        cache.zero_()
    outputs = llm.generate([texts[4]], GREEDY)
    assert outputs[0].token_ids == plain_tokens[4]
    assert outputs[0].stats.steps_per_num_drafts == {1: outputs[0].stats.steps}
    assert state.draft_keys[0].abs().amax(-1).gt(0).sum() >= len(texts[4])
    assert state.draft_keys[1].abs().max() == 0 and state.draft_values[1].abs().max() == 0


def test_auto_with_drafts_that_are_never_accepted_chooses_k0(tiny_checkpoint):
    """Random MTP modules: the calibration finds no draft accepted, so every request step costs what k=0 costs (until
    a streak of explore_after k=0 steps, 32, makes one step draft)."""
    llm = LLM(tiny_checkpoint("llama").path, num_speculative_tokens="auto", max_seq_len=64, max_batch_size=2,
              graph_mode="eager")
    assert llm.engine.chooser.acceptance[0] < 0.1
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], [9]], params)
    for output in outputs:
        assert output.stats.steps_per_num_drafts == {0: output.stats.steps}
    # Holding k=0, auto admits with the plain prefill: no draft depth runs at all, as with a k=0 engine.
    llm.engine.chooser.explore_after = 10**9  # and no step explores
    state = llm.engine.state
    for cache in state.draft_keys + state.draft_values:
        cache.zero_()
    again = llm.generate([[5, 6, 7], [9]], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    assert all(cache.abs().max() == 0 for cache in state.draft_keys + state.draft_values)


def test_the_chooser_maximizes_expected_tokens_per_second():
    chooser = DraftLengthChooser(3)
    chooser.seconds = {(1, Drafts(k)): 1.0 + 0.2 * k for k in range(4)}
    chooser.acceptance = [0.9, 0.8, 0.7]  # expected tokens 1, 1.9, 2.62, 3.12 -> per second 1, 1.58, 1.87, 1.95
    assert chooser.choose(1) == Drafts(3)
    chooser.acceptance = [0.5, 0.3, 0.1]  # 1, 1.5, 1.65, 1.665 -> 1, 1.25, 1.18, 1.04
    assert chooser.choose(1) == Drafts(1)
    chooser.acceptance = [0.1, 0.1, 0.1]
    assert chooser.choose(1) == Drafts(0)
    chooser.observe_step(1, Drafts(3), 1.6, [LaneOutcome(verified=2, accepted=2)])  # 2 hits; position 3 not verified
    assert chooser.acceptance[2] == 0.1 and chooser.acceptance[0] > 0.1


def test_after_a_streak_of_k0_steps_the_chooser_tries_drafts_once_and_learns_from_them():
    """Estimates that fell would otherwise keep k at 0 for good: no k=0 step observes acceptance. The engine's steps
    that explore verify drafts: test_ngram_drafts.py."""
    chooser = DraftLengthChooser(2, explore_after=4)
    chooser.seconds = {(1, Drafts(k)): 1.0 + 0.4 * k for k in range(3)}
    chooser.acceptance = [0.2, 0.2]  # per second: 1, 0.86, 0.69
    # Two steps: the first drafts, the second verifies those drafts.
    assert [chooser.choose(1).k for _ in range(13)] == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    for _ in range(60):  # the drafts are in fact always accepted: the explored steps raise the estimates
        if chooser.choose(1).k:
            chooser.observe_step(1, Drafts(1), 1.4, [LaneOutcome(verified=1, accepted=1)] * 8)
    assert chooser.choose(1).k > 0 and chooser.acceptance[0] > 0.4


def test_the_chooser_keeps_its_k_until_another_is_clearly_faster():
    """Within switch_margin (3%) of the best, the last k of the bucket stays: a switch up finds stale rows in the
    depths the smaller k did not run."""
    chooser = DraftLengthChooser(2)
    chooser.seconds = {(1, Drafts(0)): 1.0, (1, Drafts(1)): 1.5, (1, Drafts(2)): 2.0}
    chooser.acceptance = [0.6, 0.0]  # per second: 1, 1.067, 0.8
    assert chooser.choose(1) == Drafts(1)
    chooser.acceptance = [0.52, 0.0]  # 1, 1.013: k=0 is faster, but by less than 3%
    assert chooser.choose(1) == Drafts(1)
    chooser.seconds.update({(8, Drafts(0)): 1.0, (8, Drafts(1)): 3.0, (8, Drafts(2)): 4.0})  # a k per bucket
    assert chooser.choose(8) == Drafts(0) and chooser.choose(1) == Drafts(1)
    chooser.acceptance = [0.4, 0.0]  # 1, 0.933: k=0 is 7% faster
    assert chooser.choose(1) == Drafts(0)
    chooser.acceptance = [0.52, 0.0]
    assert chooser.choose(1) == Drafts(0)


def test_sampled_tokens_keep_the_target_distribution_while_k_switches(tiny_checkpoint):
    """Seeded sampling, the schedule above: the joint of the first three tokens is the target's (chi-square)."""
    checkpoint = tiny_checkpoint("tiny_vocab")
    llm = scheduled(LLM(checkpoint.path, num_speculative_tokens="auto", max_speculative_tokens=K, max_seq_len=8,
                        max_batch_size=256, graph_mode="eager"))
    records = record_steps(llm)
    requests = 1000
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=50_000 + i, temperature=1.0) for i in range(requests)]
    tokens = np.array([o.token_ids for o in llm.generate([PROMPT] * requests, params)])
    assert any(verified < k for k, verified, _ in lane_counts(records))
    assert goodness_of_fit(tokens, exact_joint(checkpoint.model, dict(temperature=1.0))) > GOOD_P


def test_a_stale_draft_count_is_caught(prompts, plain_tokens, eager_switching):
    """The fault: a step that leaves draft_counts unwritten, so a slot's drafts from an older step still count
    as valid. Compiled, the state-mutation pass rejects the graph; eager, stale drafts get verified and
    accepted (a lane accepts more drafts than it validly held) while the greedy output stays right."""
    path, texts = prompts
    llm = scheduled(LLM(path, graph_mode="eager", **ENGINE))
    engine = llm.engine
    engine.runner = StepRunner(llm.model, engine.state, engine.constants, GraphMode.EAGER,
                               step_function=step_without_draft_counts, step_drafts=tuple(map(Drafts, range(K + 1))))
    records = record_steps(llm)
    k_before = engine.last_num_drafts
    outputs = llm.generate(texts, GREEDY)
    assert [o.token_ids for o in outputs] == plain_tokens
    assert any(accepted > held for held, accepted in validly_held(records, k_before))
    assert lane_counts(records) != lane_counts(eager_switching[1])

    compiled = StepRunner(llm.model, engine.state, engine.constants, GraphMode.COMPILE,
                          step_function=step_without_draft_counts, step_drafts=tuple(map(Drafts, range(K + 1))))
    with pytest.raises(Exception) as raised:
        compiled.step(4, Drafts(1))
    assert "decode state updated outside the graph: draft_counts" in audit_failure(raised.value)


def test_every_step_updates_the_chains_estimate_and_the_tree_follows_it():
    """A tree step tests the chain's draft at each depth first, with the chain's own test, so it moves the chains'
    estimates too: a path that ended on a leaf at depth d is a chain step that accepted d - 1. What only a tree step
    shows is a leaf's acceptance where the chain's draft was rejected. The tree's expected tokens are built from
    both, so they follow the chains' while the tree is not chosen."""
    tree = Drafts(2, tree=True)
    chooser = DraftLengthChooser(max_drafts=2, draft_tree=(2, 1))
    assert chooser.candidates == [Drafts(0), Drafts(1), Drafts(2), tree]
    assert chooser.leaf_acceptance == [1.0, 0.0]  # depth 2 has no leaf
    chooser.acceptance = [0.6, 0.5]  # chains: 1, 1.6, 1.9
    chooser.leaf_acceptance = [0.5, 0.0]  # the tree: 1 + (0.6 + 0.4 * 0.5) + 0.6 * 0.5 = 2.1
    assert chooser.expected_tokens(tree) == pytest.approx(2.1)
    chooser.seconds = {(1, Drafts(0)): 1.0, (1, Drafts(1)): 1.2, (1, Drafts(2)): 1.4, (1, tree): 1.5}
    assert chooser.choose(1) == tree  # 2.1 / 1.5 = 1.4 against 1.9 / 1.4 = 1.36
    # A tree step whose path ended on the depth-1 leaf: the chain's depth-1 draft was rejected.
    chooser.observe_step(1, tree, 1.5, [LaneOutcome(verified=2, accepted=1, on_leaf=True)])
    assert chooser.acceptance[0] < 0.6 and chooser.acceptance[1] == 0.5 and chooser.leaf_acceptance[0] > 0.5
    # A tree step that accepted the chain's two drafts: both chain positions hit, no leaf was tested.
    leaf_before = list(chooser.leaf_acceptance)
    chooser.observe_step(1, tree, 1.5, [LaneOutcome(verified=2, accepted=2)])
    assert chooser.acceptance[1] > 0.5 and chooser.leaf_acceptance == leaf_before
    # Chain steps that reject depth 1 lower the tree's estimate too, though its leaves were not tested.
    before = chooser.expected_tokens(tree)
    for _ in range(40):
        chooser.observe_step(1, Drafts(2), 1.4, [LaneOutcome(verified=2, accepted=0)])
    assert chooser.expected_tokens(tree) < before - 0.2 and chooser.leaf_acceptance == leaf_before


def test_calibration_steps_seed_the_chains_and_the_leaves():
    chooser = DraftLengthChooser(max_drafts=2, draft_tree=(3, 2))
    chain, tree = Drafts(2), Drafts(2, tree=True)
    chooser.seed_acceptance([(chain, LaneOutcome(2, 2)), (chain, LaneOutcome(2, 0)),
                             (tree, LaneOutcome(2, 1, on_leaf=True)), (tree, LaneOutcome(2, 2, on_leaf=True)),
                             (tree, LaneOutcome(2, 0))])
    # Depth 1: the chain's draft accepted in 2 of 5 steps; depth 2 reached by those 2, accepted in 1.
    assert chooser.acceptance == [2 / 5, 1 / 2]
    # Leaves tested where the chain's draft was rejected: at depth 1 in 2 steps (one accepted), at depth 2 in one.
    assert chooser.leaf_acceptance == [1 / 2, 1.0]


def test_the_tree_competes_with_the_chain_of_its_depth():
    """The tree drafts what the chain of its depth drafts and verifies more rows: where its extra acceptance does
    not pay for those rows the chain of its depth wins, not a shorter chain."""
    tree = Drafts(2, tree=True)
    chooser = DraftLengthChooser(max_drafts=3, draft_tree=(2, 1))
    chooser.seconds = {(1, Drafts(0)): 1.0, (1, Drafts(1)): 1.2, (1, Drafts(2)): 1.4, (1, Drafts(3)): 1.9,
                       (1, tree): 1.8}
    chooser.acceptance = [0.7, 0.6, 0.2]  # chains per second: 1, 1.7 / 1.2 = 1.42, 2.12 / 1.4 = 1.51, 2.20 / 1.9 = 1.16
    chooser.leaf_acceptance = [1 / 3, 0.0]  # the tree: 1 + 0.7 + 0.3 / 3 + 0.42 = 2.22 / 1.8 = 1.23
    assert chooser.choose(1) == Drafts(2)
    chooser.seconds.update({(2, drafts): seconds for (_, drafts), seconds in chooser.seconds.items()})
    chooser.seconds[(2, tree)] = 1.4  # in another bucket its rows cost less: 2.22 / 1.4 = 1.59
    assert chooser.choose(2) == tree


def test_a_tree_step_tests_each_chain_draft_as_the_chain_step_does(prompts):
    """What the chooser counts on: from the same state, a tree step accepts what the chain step of its depth accepts,
    one more where its path ended on a leaf; for sampled requests too (the chain's test, key and residual)."""
    path, texts = prompts
    llm = LLM(path, graph_mode="eager", draft_tree=(2, 2), **ENGINE)
    engine, state = llm.engine, llm.engine.state
    for index, text in enumerate(texts[:4]):
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=index)
        engine.admit(Request(index, text, params, index, RequestOutput(prompt_token_ids=text, stats=SpecStats(K))))
    lanes = []
    for _ in range(10):  # at most 3 tokens a step: no request finishes
        saved = [tensor.clone() for tensor in state.tensors()]
        engine.runner.step(4, Drafts(2))
        chain = state.step_accepted[:4].tolist()
        for tensor, copy in zip(state.tensors(), saved):
            tensor.copy_(copy)
        engine.runner.step(4, Drafts(2, tree=True))
        lanes += zip(chain, state.step_accepted[:4].tolist(), state.step_on_leaf[:4].tolist())
    assert [chain for chain, _, _ in lanes] == [tree - leaf for _, tree, leaf in lanes]
    assert any(leaf for _, _, leaf in lanes) and any(chain < 2 and not leaf for chain, _, leaf in lanes)


def test_auto_with_a_tree_is_calibrated_for_both_and_keeps_greedy_output(prompts, plain_tokens):
    path, texts = prompts
    llm = LLM(path, graph_mode="eager", draft_tree=(2, 2), **ENGINE)
    chooser = llm.engine.chooser
    assert chooser.candidates == [Drafts(0), Drafts(1), Drafts(2), Drafts(2, tree=True)]
    assert {drafts for _, drafts in chooser.seconds} == set(chooser.candidates)  # each step timed at warm-up
    # Calibration decoded with the K=2 chain and with the tree: no estimate is the untouched 1.0.
    assert max(chooser.acceptance) < 1.0 and max(chooser.leaf_acceptance) < 1.0
    assert [o.token_ids for o in llm.generate(texts, GREEDY)] == plain_tokens
    # Switching between chains and the tree mid-request, the chain of the tree's depth included (a tree step then
    # verifies leaves a chain step drafted, or none), keeps the output too.
    llm.engine.chooser = ScheduledChooser([2, Drafts(2, tree=True), 1, Drafts(2, tree=True), Drafts(2, tree=True),
                                           0, 2, 2, Drafts(2, tree=True)], draft_tree=(2, 2))
    records = record_steps(llm)
    outputs = llm.generate(texts, GREEDY)
    assert [o.token_ids for o in outputs] == plain_tokens
    tree_steps = sum(record.tree for record in records)
    assert tree_steps and sum(record.num_drafts == 2 and not record.tree for record in records)
    assert sum(o.stats.tree_steps for o in outputs) == sum(record.tree * len(record.lanes) for record in records)
    assert sum(o.stats.leaf_steps for o in outputs) == sum(sum(record.on_leaf) for record in records)
