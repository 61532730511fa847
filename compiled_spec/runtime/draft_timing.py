"""What k = auto's chooser learns at warm-up: the seconds of every (batch bucket, chain or tree) step, and acceptance
rates from one calibration request per kind of step (chain, tree)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..params import RequestOutput, SamplingParams, SpecStats
from ..speculative.step import Drafts
from .draft_chooser import LaneOutcome
from .request import Request

if TYPE_CHECKING:
    from .engine import Engine


def time_steps(engine: Engine, rounds: int = 9) -> None:
    """Seconds per step of every (bucket, chain or tree) over free slots: the fastest of several rounds that take
    each in turn, so a slow moment of the machine (noise only ever adds time) lands on all of them or none."""
    candidates = engine.chooser.candidates
    for size in engine.batch_buckets:
        for drafts in candidates:  # first calls: allocations, lazy kernel set-up
            for _ in range(2):
                engine.runner.step(size, drafts)
        best = [float("inf")] * len(candidates)
        for _ in range(rounds):
            for index, drafts in enumerate(candidates):
                begin = time.perf_counter()
                engine.runner.step(size, drafts)
                engine.state.step_emitted[:size].tolist()  # the host copy a live step makes
                best[index] = min(best[index], time.perf_counter() - begin)
        for drafts, seconds in zip(candidates, best):
            engine.chooser.seconds[(size, drafts)] = seconds


def calibrate(engine: Engine, prompt_ids: list[int], max_tokens: int = 48) -> None:
    """Decodes one greedy request with the longest chain (K drafts) and, with a token tree, one with the tree, and
    seeds the chooser's acceptance estimates from the steps of both."""
    chooser = engine.chooser
    runs = [Drafts(chooser.max_drafts)] if chooser.max_drafts else []
    steps = []
    for drafts in runs + [candidate for candidate in chooser.candidates if candidate.tree]:
        output = RequestOutput(prompt_token_ids=list(prompt_ids), stats=SpecStats(engine.max_drafts))
        request = Request(-1, list(prompt_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, output)
        fixed = FixedDrafts(drafts)
        engine.chooser, engine.last_num_drafts = fixed, drafts.k  # admits with k, steps with drafts
        try:
            engine.admit(request)
            while engine.slots:
                engine.step()
        finally:
            engine.chooser = chooser
        steps += fixed.observed
    chooser.seed_acceptance(steps)


class FixedDrafts:
    """A chooser that always chooses the same chain or tree (calibration; bench's forced runs) and keeps what each
    lane's step verified: [(drafts, LaneOutcome)]."""

    def __init__(self, drafts: Drafts):
        self.drafts = drafts
        self.observed: list[tuple[Drafts, LaneOutcome]] = []

    def choose(self, bucket: int) -> Drafts:
        return self.drafts

    def observe_step(self, bucket: int, drafts: Drafts, seconds: float, lanes: list[LaneOutcome]) -> None:
        self.observed += [(drafts, lane) for lane in lanes]
