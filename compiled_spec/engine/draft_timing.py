"""What k = auto's chooser learns at warm-up: the seconds of every (batch bucket, chain or tree) step, and acceptance
rates from one calibration request per kind of step (chain, tree)."""

from __future__ import annotations

import time

from ..compiler.step_runner import StepRunner
from ..params import RequestOutput, SamplingParams, SpecStats
from ..speculative.state import DecodeState
from ..speculative.step import Drafts
from .draft_chooser import LaneOutcome
from .request import Request


def time_steps(runner: StepRunner, state: DecodeState, chooser, batch_buckets: list[int], rounds: int = 9) -> None:
    """Seconds per step of every (bucket, chain or tree) over free slots, into chooser.seconds: the fastest of several
    rounds that take each in turn, so a slow moment of the machine (noise only ever adds time) lands on all of them
    or none."""
    candidates = chooser.candidates
    for size in batch_buckets:
        for drafts in candidates:  # first calls: allocations, lazy kernel set-up
            for _ in range(2):
                runner.step(size, drafts)
        best = [float("inf")] * len(candidates)
        for _ in range(rounds):
            for index, drafts in enumerate(candidates):
                begin = time.perf_counter()
                runner.step(size, drafts)
                state.step_emitted[:size].tolist()  # the host copy a live step makes
                best[index] = min(best[index], time.perf_counter() - begin)
        for drafts, seconds in zip(candidates, best):
            chooser.seconds[(size, drafts)] = seconds


def calibration_request(prompt_ids: list[int], max_tokens: int, max_drafts: int) -> Request:
    """One greedy request that calibration decodes to its end (ignoring EOS)."""
    output = RequestOutput(prompt_token_ids=list(prompt_ids), stats=SpecStats(max_drafts))
    return Request(-1, list(prompt_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, output)


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
