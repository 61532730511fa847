"""k = auto: before each step, the chain of k drafts (or the token tree) that maximizes expected tokens per second.

Expected tokens of a chain step that drafts k: 1 + sum over j <= k of a_1 * ... * a_j, where a_i is the running
chance that draft i is accepted once drafts 1..i-1 were (decayed per observation, seeded by calibration requests at
warm-up). Seconds per step: per (batch bucket, chain or tree), the fastest of several rounds over the compiled graphs
at warm-up. Live step times do not update them: one slow step would make its k look costly, and a k that is not
chosen is never measured again to correct it. k=0 is always a candidate, so by these estimates no step is chosen
to be slower per token than plain decoding. But k=0 observes no acceptance: estimates that fell (on text unlike the
calibration prompt, or n-gram drafts before the output starts to repeat) would keep k at 0 for good. So after
explore_after k=0 steps in a row in a bucket, two steps draft the best k > 0 (by the estimates): a step verifies the
drafts the step before it made, so the first drafts and the second verifies, and what it accepts moves the
estimates. It costs at most two slower steps in explore_after + 2.

A step that drafts k runs draft depths 1..k only (speculative/step.py), so after steps at a smaller k the deeper
depths hold stale rows. The chooser therefore keeps its last choice in a bucket until another is expected to be
switch_margin faster: near-equal estimates do not make it flap between two.

With a token tree (speculative/tree.py) its step is a candidate beside every chain, the chain of its depth included.
It drafts what that chain drafts and tests the chain's draft at each depth first, with the chain's own test, so
every step, chain or tree, updates the chains' a_i: a tree step whose path ended on a leaf at depth d is a chain step
that accepted d - 1. What only a tree step shows is l_d, the chance that a leaf at depth d is accepted when the
chain's draft there was rejected; a leaf ends the path, so the tree's expected tokens are
1 + sum over d of a_1 * ... * a_{d-1} * (a_d + (1 - a_d) * l_d). The tree's estimate thus follows the chains' while
the tree is not chosen: an estimate moved only by the tree's own steps would go stale while a chain is chosen, and
could keep choosing the tree.
"""

from __future__ import annotations

from typing import NamedTuple

from ..speculative.step import Drafts


class LaneOutcome(NamedTuple):
    """What one lane's step verified: drafts verified, drafts accepted, and whether the last accepted one was a leaf
    of the token tree."""

    verified: int
    accepted: int
    on_leaf: bool = False


class DraftLengthChooser:
    def __init__(self, max_drafts: int, acceptance_decay: float = 0.98, switch_margin: float = 0.03,
                 draft_tree: tuple[int, ...] | None = None, explore_after: int = 32):
        self.max_drafts = max_drafts
        self.explore_after = explore_after
        self.zero_streak: dict[int, int] = {}  # bucket -> k=0 steps chosen in a row
        self.exploring: dict[int, Drafts] = {}  # bucket -> the drafts of the exploration's second step
        self.switch_margin = switch_margin
        self.draft_tree = tuple(draft_tree or ())  # widths per depth; () without a tree
        # Every chain 0..K, then the token tree (its depth is at most K).
        self.candidates = [Drafts(k) for k in range(max_drafts + 1)] + ([Drafts(len(self.draft_tree), True)]
                                                                         if self.draft_tree else [])
        self.chosen: dict[int, Drafts] = {}  # bucket -> what was last chosen for it from timed estimates
        self.acceptance = [1.0] * max_drafts  # a_i, optimistic until observed: calibration replaces it
        # l_d per depth of the tree; 0 where the depth has no leaves.
        self.leaf_acceptance = [1.0 if width > 1 else 0.0 for width in self.draft_tree]
        self.seconds: dict[tuple[int, Drafts], float] = {}  # (bucket, chain or tree) -> seconds per step
        self.acceptance_decay = acceptance_decay

    def expected_tokens(self, drafts: Drafts) -> float:
        total, reach = 1.0, 1.0
        for depth, rate in enumerate(self.acceptance[:drafts.k]):
            if drafts.tree:
                total += reach * (1 - rate) * self.leaf_acceptance[depth]
            reach *= rate
            total += reach
        return total

    def choose(self, bucket: int) -> Drafts:
        """The chain or tree with the most expected tokens per second in this bucket (on a tie the smaller k, a chain
        before the tree), unless the one chosen last in this bucket is within switch_margin of it; after explore_after
        k=0 steps in a row, the best with drafts, for two steps. One whose step was never timed in this bucket (no warm-up) is
        chosen first, so the live step times it."""
        untimed = [drafts for drafts in self.candidates if (bucket, drafts) not in self.seconds]
        if untimed:
            return untimed[0]
        if bucket in self.exploring:
            return self.exploring.pop(bucket)
        rates = {drafts: self.expected_tokens(drafts) / self.seconds[(bucket, drafts)] for drafts in self.candidates}
        best = max(rates, key=lambda drafts: (rates[drafts], -drafts.k, -drafts.tree))
        last = self.chosen.get(bucket)
        if last is None or rates[best] > rates[last] * (1 + self.switch_margin):
            self.chosen[bucket] = last = best
        streak = self.zero_streak[bucket] = self.zero_streak.get(bucket, 0) + 1 if last.k == 0 else 0
        if streak > self.explore_after and self.max_drafts:
            self.zero_streak[bucket] = 0
            explore = max((drafts for drafts in self.candidates if drafts.k), key=lambda drafts: rates[drafts])
            self.exploring[bucket] = explore
            return explore
        return last

    def observe_step(self, bucket: int, drafts: Drafts, seconds: float, lanes: list[LaneOutcome]) -> None:
        """A lane verifies fewer than k drafts when the step before it drafted fewer; positions it did not verify
        tell nothing. `seconds` is kept only for a (bucket, chain or tree) that warm-up did not time."""
        self.seconds.setdefault((bucket, drafts), seconds)
        decay = self.acceptance_decay
        for lane in lanes:
            chain, leaf = self.observations(drafts, lane)
            for position, hit in chain:
                self.acceptance[position] = decay * self.acceptance[position] + (1 - decay) * hit
            for depth, hit in leaf:
                self.leaf_acceptance[depth] = decay * self.leaf_acceptance[depth] + (1 - decay) * hit

    def seed_acceptance(self, steps: list[tuple[Drafts, LaneOutcome]]) -> None:
        """Replaces the running estimates by the rates calibration steps measured; an estimate no step observed
        keeps its value."""
        chain_counts = [[0, 0] for _ in self.acceptance]  # per position: hits, observations
        leaf_counts = [[0, 0] for _ in self.leaf_acceptance]
        for drafts, lane in steps:
            for counts, observed in zip((chain_counts, leaf_counts), self.observations(drafts, lane)):
                for index, hit in observed:
                    counts[index][0] += hit
                    counts[index][1] += 1
        for rates, counts in ((self.acceptance, chain_counts), (self.leaf_acceptance, leaf_counts)):
            for index, (hits, observed) in enumerate(counts):
                if observed:
                    rates[index] = hits / observed

    def observations(self, drafts: Drafts, lane: LaneOutcome) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
        """(position, accepted) of each chain draft the lane tested: drafts 1..n were accepted and, if n < verified,
        draft n+1 was rejected, n being the accepted count less a final leaf; and with a tree, (depth, accepted) of
        the leaves tested where the chain's draft was rejected."""
        chain_accepted = lane.accepted - lane.on_leaf
        chain = [(position, position < chain_accepted) for position in range(min(chain_accepted + 1, lane.verified))]
        rejected = chain_accepted  # the depth index whose chain draft was rejected, if one was
        leaf_tested = drafts.tree and rejected < lane.verified and self.draft_tree[rejected] > 1
        return chain, [(rejected, lane.on_leaf)] if leaf_tested else []
