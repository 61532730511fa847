"""Wires the pure step and prefill functions to a graph mode."""

from __future__ import annotations

import functools

import torch

from ..config import GraphMode
from ..model.causal_lm import CausalLM
from ..spec.state import DecodeState
from ..spec.step import StepConstants, prefill, speculative_step


class StepRunner:
    """Calls the step and prefill for one engine, eagerly or through torch.compile."""

    def __init__(self, model: CausalLM, state: DecodeState, constants: StepConstants, mode: GraphMode):
        self.mode = mode
        step = functools.partial(speculative_step, model, state, constants)
        fill = functools.partial(prefill, model, state, constants)
        if mode == GraphMode.EAGER:
            self._step, self._prefill = step, fill
        else:
            options = dict(fullgraph=True, dynamic=False)
            if mode == GraphMode.FULL:
                options["mode"] = "max-autotune"
            self._step = torch.compile(step, **options)
            self._prefill = torch.compile(fill, **options)

    @torch.inference_mode()
    def step(self, batch_size: int) -> None:
        self._step(batch_size)

    @torch.inference_mode()
    def prefill(self, slot: torch.Tensor, prompt_ids: torch.Tensor, prompt_len: torch.Tensor) -> None:
        self._prefill(slot, prompt_ids, prompt_len)
