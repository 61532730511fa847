"""The graph canary: every N-th step runs in eager too, and a compiled step that writes anything else is replaced.

The step is a pure function of DecodeState, so a compiled step can be checked at any step: copy the state, run the
eager step on the copy, run the compiled step on the state, and compare every field of the two states (the whole
state, not a list of anticipated faults: whatever the compiled step wrote differently shows). Integers and flags
must be equal; floats (probabilities, KV rows, hidden states) within FLOAT_TOLERANCE.

On a mismatch the eager result is copied into the state's own buffers (nothing of that step has been emitted yet,
so the tokens that leave the engine are eager's), one line names the field, lane and step, and the engine falls back
to the next safer graph mode (full or piecewise -> compile -> eager) before its next step.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..config import GraphMode
from ..speculative.state import DecodeState
from ..speculative.step import Drafts, speculative_step

logger = logging.getLogger("compiled_spec.canary")

# (rtol, atol) for floating fields: compiled and eager kernels sum in different orders.
FLOAT_TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.float16: (1e-2, 1e-3), torch.bfloat16: (3e-2, 1e-2)}
# serve's rate: at most one checked step in 256, and fewer where a check costs more than SERVE_BUDGET of the time
# (docs/graph-modes.md, "The graph canary").
SERVE_VERIFY_GRAPHS_EVERY = 256
SERVE_BUDGET = 0.02
SAFER_MODE = {GraphMode.FULL: GraphMode.COMPILE, GraphMode.PIECEWISE: GraphMode.COMPILE,
              GraphMode.COMPILE: GraphMode.EAGER}


@dataclass(frozen=True)
class Divergence:
    field: str  # a DecodeState field, e.g. "step_accepted" or "main_keys[0]"
    lane: int  # the first slot where it differs
    step: int  # the engine's step number (1 = the first step)
    detail: str

    def __str__(self) -> str:
        return f"graph divergence at step {self.step}: {self.field} differs in lane {self.lane} ({self.detail})"


def copy_state(state: DecodeState) -> DecodeState:
    return state.with_tensors([tensor.clone() for tensor in state.tensors()])


# Fields whose last row (dim 1) is a trash row: writes that must land nowhere go there, in any order, so it holds
# anything (the KV caches' trash position, the hot buffers' spare row, the token history's last column).
TRASH_ROW_FIELDS = ("main_keys", "main_values", "draft_keys", "draft_values", "index_keys", "hot_keys", "hot_values",
                    "hot_positions", "hot_last_used", "token_history")


# Fields of token ids ranked by a float field: where two ranks' values tie within the float tolerance, compiled and
# eager may order them either way, so an id may differ where the ranked values agree.
RANKED_BY = {"step_top_ids": "step_top_logprobs"}


def first_difference(compiled: DecodeState, eager: DecodeState, step: int) -> Divergence | None:
    """The first field (in field order) where the compiled state differs from the eager one, or None."""
    for (name, got), (_, want) in zip(compiled.named_tensors(), eager.named_tensors()):
        if name.split("[")[0].rsplit(".", 1)[-1] in TRASH_ROW_FIELDS:
            got, want = got[:, :-1], want[:, :-1]
        got, want = got.reshape(got.shape[0], -1), want.reshape(want.shape[0], -1)
        unequal = (got != want).nonzero()  # [n, 2]: (lane, element); a KV cache differs in this step's rows only
        if unequal.shape[0] == 0:
            continue
        if got.is_floating_point() or name in RANKED_BY:
            values = (got, want) if got.is_floating_point() else (
                getattr(compiled, RANKED_BY[name]).reshape(got.shape), getattr(eager, RANKED_BY[name]).reshape(got.shape))
            rtol, atol = FLOAT_TOLERANCE.get(values[0].dtype, FLOAT_TOLERANCE[torch.float32])
            lanes, elements = unequal.unbind(1)
            close = torch.isclose(values[0][lanes, elements], values[1][lanes, elements], rtol=rtol, atol=atol,
                                  equal_nan=True)
            unequal = unequal[~close]
            if unequal.shape[0] == 0:
                continue
        lane, element = unequal[0].tolist()
        detail = f"compiled {got[lane, element].item()!r}, eager {want[lane, element].item()!r} at element {element}"
        return Divergence(name, lane, step, detail)
    return None


class GraphCanary:
    """Checks every `every`-th step of an engine against eager (engine.step calls checked_step on those).

    budget: a fraction of decode time the checks may take (serve's); a check that costs more than that over `every`
    steps stretches the interval to the next one: with a check's extra time x and a step's time t, one check in N
    steps costs x / (N t + x) of the time."""

    def __init__(self, every: int, budget: float | None = None):
        if every < 1:
            raise ValueError(f"verify_graphs_every={every} must be 1 or more")
        self.every = every
        self.budget = budget
        self.next_check = every
        self.checked_steps: list[int] = []
        self.divergences: list[Divergence] = []
        self.extra_seconds: float | None = None  # the last check's own time: state copy, eager step, comparison
        self._step_seconds: deque[float] = deque(maxlen=64)  # unchecked steps

    def due(self, step: int) -> bool:
        """Whether the engine's step number `step` (1 = the first) is checked."""
        return step >= self.next_check

    def observe(self, step: int, seconds: float, checked: bool) -> None:
        """The engine's step number `step` took `seconds`; after a checked one, sets the next check."""
        if not checked:
            self._step_seconds.append(seconds)
            return
        interval = self.every
        if self.budget and self._step_seconds and self.extra_seconds:
            step_seconds = statistics.median(self._step_seconds)
            interval = max(interval, math.ceil(self.extra_seconds * (1 - self.budget) / (self.budget * step_seconds)))
        self.next_check = step + interval

    @torch.inference_mode()
    def checked_step(self, engine, batch_size: int, drafts: Drafts, step: int) -> Divergence | None:
        """Runs the engine's step and the eager step on a copy of its state; on a mismatch leaves the eager result
        in the state, logs it and makes the engine fall back. Returns the mismatch, or None."""
        self.checked_steps.append(step)
        begin = time.perf_counter()
        reference = copy_state(engine.state)
        constants = engine.constants._replace(opaque_attention=False)  # eager mode's own step
        speculative_step(engine.model, reference, constants, batch_size, *drafts)
        extra = time.perf_counter() - begin
        engine.runner.step(batch_size, drafts)
        begin = time.perf_counter()
        divergence = first_difference(engine.state, reference, step)
        self.extra_seconds = extra + time.perf_counter() - begin
        if divergence is None:
            return None
        for tensor, eager in zip(engine.state.tensors(), reference.tensors()):
            tensor.copy_(eager)
        logger.warning("compiled-spec: %s; falling back from %s to %s", divergence, engine.runner.mode.value,
                       SAFER_MODE.get(engine.runner.mode, GraphMode.EAGER).value)
        self.divergences.append(divergence)
        engine.fall_back()
        return divergence
