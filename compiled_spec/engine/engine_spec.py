"""What builds one engine, every default resolved: the model's files, how its weights are held, and the EngineConfig.

LLM makes one from its arguments; a compile process (engine/compile_worker.py) gets it pickled and builds the same
model, state and step constants from it, so the packages it compiles are the ones the engine names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig
from ..hisparse.indexer import attach_indexers
from ..loading.checkpoint import load_model
from ..loading.tokenizer import eos_token_ids, load_tokenizer
from ..model.causal_lm import CausalLM


@dataclass(frozen=True)
class EngineSpec:
    model: Path  # a checkpoint directory or a .gguf file
    mtp: Path | None  # MTP modules stored apart from the model
    draft_vocab_size: int | None
    draft_dtype: str  # the drafts' weights: "float16" or the engine's dtype
    dequantize: bool
    quantize: str | None
    config: EngineConfig  # validated against the model

    def load_weights(self) -> CausalLM:
        """The model as the checkpoint and the weight options make it (no HiSparse indexers yet)."""
        return load_model(self.model, self.config.torch_dtype(), self.config.device, mtp=self.mtp,
                          draft_vocab_size=self.draft_vocab_size, draft_dtype=getattr(torch, self.draft_dtype),
                          dequantize=self.dequantize, quantize=self.quantize)

    def attach_indexers(self, model: CausalLM) -> None:
        """HiSparse's indexers, where the (validated) config asks for HiSparse."""
        if self.config.hisparse is not None:
            attach_indexers(model, self.model, self.config.hisparse.scorer)

    def load_model(self) -> CausalLM:
        """The whole model of a validated spec (a compile process's)."""
        model = self.load_weights()
        self.attach_indexers(model)
        return model

    def load_tokenizer(self, model: CausalLM):
        """(tokenizer or None, the end-of-sequence ids)."""
        tokenizer = load_tokenizer(self.model)
        return tokenizer, eos_token_ids(self.model, model.config.eos_token_ids, tokenizer)

    def with_config(self, **changes) -> EngineSpec:
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))
