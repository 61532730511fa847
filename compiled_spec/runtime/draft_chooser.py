"""k = auto: before each step, the chain of k drafts (or the token tree) that maximizes expected tokens per second.

Expected tokens of a step that drafts k: 1 + sum over j <= k of a_1 * ... * a_j, where a_i is the running
chance that draft i is accepted once drafts 1..i-1 were (decayed per observation, seeded by a calibration
request at warm-up). Seconds per step: per (batch bucket, chain or tree), the fastest of several rounds over the
compiled graphs at warm-up. Live step times do not update them: one slow step would make its k look costly, and a k
that is not chosen is never measured again to correct it. k=0 is always a candidate, so by these estimates
no step is chosen to be slower per token than plain decoding.

A step that drafts k runs draft depths 1..k only (speculative/step.py), so after steps at a smaller k the deeper
depths hold stale rows. The chooser therefore keeps its last choice in a bucket until another is expected to be
switch_margin faster: near-equal estimates do not make it flap between two.

With a token tree (speculative/tree.py) its step is a candidate beside every chain, the chain of its depth included:
it drafts what that chain drafts and verifies more rows, so its acceptance per depth is its own (a leaf can accept
where the chain's draft was rejected), estimated apart from the chains', and its seconds are its own.
"""

from __future__ import annotations

from ..speculative.step import Drafts


class DraftLengthChooser:
    def __init__(self, max_drafts: int, acceptance_decay: float = 0.98, switch_margin: float = 0.03,
                 tree_depth: int | None = None):
        self.max_drafts = max_drafts
        self.switch_margin = switch_margin
        # Every chain 0..K, then the token tree (its depth is at most K; None: chains only).
        self.candidates = [Drafts(k) for k in range(max_drafts + 1)] + ([Drafts(tree_depth, True)] if tree_depth
                                                                         else [])
        self.chosen: dict[int, Drafts] = {}  # bucket -> what was last chosen for it from timed estimates
        self.acceptance = [1.0] * max_drafts  # optimistic until observed: calibration replaces it
        self.tree_acceptance = [1.0] * (tree_depth or 0)
        self.seconds: dict[tuple[int, Drafts], float] = {}  # (bucket, chain or tree) -> seconds per step
        self.acceptance_decay = acceptance_decay

    def rates(self, drafts: Drafts) -> list[float]:
        """The running acceptance per position of a step: the tree's, or the chains'."""
        return self.tree_acceptance if drafts.tree else self.acceptance

    def expected_tokens(self, drafts: Drafts) -> float:
        total, reach = 1.0, 1.0
        for rate in self.rates(drafts)[:drafts.k]:
            reach *= rate
            total += reach
        return total

    def choose(self, bucket: int) -> Drafts:
        """The chain or tree with the most expected tokens per second in this bucket (on a tie the smaller k, a chain
        before the tree), unless the one chosen last in this bucket is within switch_margin of it. One whose step was
        never timed in this bucket (no warm-up) is chosen first, so the live step times it."""
        untimed = [drafts for drafts in self.candidates if (bucket, drafts) not in self.seconds]
        if untimed:
            return untimed[0]
        rates = {drafts: self.expected_tokens(drafts) / self.seconds[(bucket, drafts)] for drafts in self.candidates}
        best = max(rates, key=lambda drafts: (rates[drafts], -drafts.k, -drafts.tree))
        last = self.chosen.get(bucket)
        if last is not None and rates[best] <= rates[last] * (1 + self.switch_margin):
            return last
        self.chosen[bucket] = best
        return best

    def observe_step(self, bucket: int, drafts: Drafts, seconds: float, lanes: list[tuple[int, int]]) -> None:
        """lanes: per lane, (drafts it verified, drafts accepted). A lane verifies fewer than k drafts when the
        step before it drafted fewer; positions it did not verify tell nothing. `seconds` is kept only for a
        (bucket, chain or tree) that warm-up did not time."""
        self.seconds.setdefault((bucket, drafts), seconds)
        for verified, accepted in lanes:
            self.observe_acceptance(verified, accepted, tree=drafts.tree)

    def observe_acceptance(self, verified: int, accepted: int, tree: bool = False) -> None:
        """Drafts 1..accepted were accepted and, if accepted < verified, draft accepted+1 was rejected (tree: by
        the tree's step)."""
        decay, rates = self.acceptance_decay, self.tree_acceptance if tree else self.acceptance
        for position in range(min(accepted + 1, verified)):
            hit = 1.0 if position < accepted else 0.0
            rates[position] = decay * rates[position] + (1 - decay) * hit

    def seed_acceptance(self, accepted_per_position: list[int], verified_per_position: list[int],
                        tree: bool = False) -> None:
        """Replaces the running rates by those a calibration run measured (conditional on the previous position);
        tree: the run's steps verified the tree."""
        rates = self.tree_acceptance if tree else self.acceptance
        for position in range(min(len(rates), len(verified_per_position))):
            reached = accepted_per_position[position - 1] if position else verified_per_position[0]
            if verified_per_position[position] and reached:
                rates[position] = accepted_per_position[position] / min(reached, verified_per_position[position])
