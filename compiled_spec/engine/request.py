"""A request as the engine holds it, and the record of one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..detokenizer import IncrementalDetokenizer
from ..params import RequestOutput, SamplingParams
from .structured_output import Constraint

if TYPE_CHECKING:
    from .canary import Divergence

TokenCallback = Callable[[int, list[int]], None]


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output: RequestOutput
    detokenizer: IncrementalDetokenizer | None = None  # with stop strings: the text so far, to find them in
    siblings: list["Request"] = field(default_factory=list)  # choices 1..n-1 (n > 1), admitted with this one
    grammar: Any = None  # SamplingParams.json_schema compiled (engine/structured_output.py), shared by the choices
    constraint: Constraint | None = None  # this choice's place in the grammar, from its admission

    @property
    def choices(self) -> list["Request"]:
        """This request and its siblings, choice 0 first."""
        return [self] + self.siblings


@dataclass
class StepRecord:
    finished: list[Request]  # requests this step finished; their slots are free again
    lanes: list[tuple[int, int]]  # per lane: (request index, accepted drafts)
    seconds: float  # wall time, the host copy of the step's results included
    num_drafts: int = 0  # k: the drafts this step made for the next one
    verified: list[int] | None = None  # per lane: drafts it verified (fewer than k after a step with a smaller k)
    divergence: Divergence | None = None  # the canary checked this step and found the compiled one wrong
    tree: bool = False  # the step verified the token tree (num_drafts: its depth)
    on_leaf: list[bool] | None = None  # per lane: its accepted path ended on one of the tree's leaves
    lane_drafts: list[int] | None = None  # per lane: the drafts it made (num_drafts, or its request's own smaller k)
