"""What k = auto's chooser learns at warm-up: the seconds of every (batch bucket, k) step, and acceptance rates
from one calibration request."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..params import RequestOutput, SamplingParams, SpecStats
from .request import Request

if TYPE_CHECKING:
    from .engine import Engine


def time_steps(engine: Engine, rounds: int = 9) -> None:
    """Seconds per step of every (bucket, k) over free slots: the fastest of several rounds that take every k in
    turn, so a slow moment of the machine (noise only ever adds time) lands on all of them or none."""
    ks = range(engine.max_drafts + 1)
    for size in engine.batch_buckets:
        for k in ks:  # first calls: allocations, lazy kernel set-up
            for _ in range(2):
                engine.runner.step(size, k)
        best = [float("inf")] * len(ks)
        for _ in range(rounds):
            for k in ks:
                begin = time.perf_counter()
                engine.runner.step(size, k)
                engine.state.step_emitted[:size].tolist()  # the host copy a live step makes
                best[k] = min(best[k], time.perf_counter() - begin)
        for k, seconds in enumerate(best):
            engine.chooser.seconds[(size, k)] = seconds


def calibrate(engine: Engine, prompt_ids: list[int], max_tokens: int = 48) -> None:
    """Decodes one greedy request with the longest chain (K drafts, or K-1 when the tree is K deep) and, with a token
    tree, one with the tree, and seeds the chooser's acceptance estimates from them."""
    chooser = engine.chooser
    chain = chooser.max_drafts - (chooser.tree_depth == chooser.max_drafts)
    runs = ([(chain, False)] if chain else []) + ([(chooser.tree_depth, True)] if chooser.tree_depth else [])
    for k, tree in runs:
        output = RequestOutput(prompt_token_ids=list(prompt_ids), stats=SpecStats(engine.max_drafts))
        request = Request(-1, list(prompt_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, output)
        engine.chooser, engine.last_num_drafts = _FixedDrafts(k), k  # admits and steps with k
        try:
            engine.admit(request)
            while engine.slots:
                engine.step()
        finally:
            engine.chooser = chooser
        chooser.seed_acceptance(output.stats.accepted_per_position, output.stats.verified_per_position, tree=tree)


class _FixedDrafts:
    """A chooser that always chooses k and learns nothing."""

    def __init__(self, k: int):
        self.k = k

    def choose(self, bucket: int) -> int:
        return self.k

    def observe_step(self, *args) -> None:
        pass
