"""The main decoder model with its MTP modules; weights only, decode state lives in spec/state.py."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .half_weight_linear import half_weight_linear
from .layers import DecoderLayer, PassLayout, RMSNorm
from .mtp import MtpModule
from .packed_linear import PackedLinear


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, mtp_hidden_first: bool = False):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            MtpModule(config, index, mtp_hidden_first) for index in range(config.num_mtp_modules)
        )
        # Drafts may sample over a sub-vocabulary (FR-Spec, EAGLE-3's d2t): ids [V'] and their head rows [V', H].
        self.register_buffer("draft_vocab", None)
        self.register_buffer("draft_head", None)

    def use_draft_vocab(self, token_ids: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """dtype: the draft head's, when it differs from the head's (float16: see half_weight_linear.py)."""
        head = self.head()
        rows = head.rows(token_ids) if isinstance(head, PackedLinear) else head.weight[token_ids]
        self.draft_vocab = token_ids
        self.draft_head = rows.to(dtype or self.norm.weight.dtype, copy=True)

    def head(self) -> nn.Module:
        """The module whose weight [vocab, hidden] the logits multiply: the LM head, or the tied embedding."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def hidden_states(
        self,
        token_ids: torch.Tensor,
        layout: PassLayout,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        tiers: list | None = None,
    ) -> torch.Tensor:
        """token_ids [B, T] -> last hidden states after the final norm, [B, T, hidden]."""
        x = self.embed(token_ids)
        for index, (layer, key_cache, value_cache) in enumerate(zip(self.layers, key_caches, value_caches)):
            x = layer(x, layout, key_cache, value_cache, tiers[index] if tiers is not None else None)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head()
        if isinstance(head, PackedLinear):
            return head.linear(hidden).float()
        return (hidden @ head.weight.t()).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary: the whole vocabulary, or the sub-vocabulary use_draft_vocab set."""
        if self.draft_vocab is None:
            return self.logits(hidden)
        return half_weight_linear(hidden, self.draft_head).float() if self.draft_head.dtype != hidden.dtype else \
            (hidden @ self.draft_head.t()).float()

    def draft_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> token ids."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def draft_tokens_and_probs(self, index: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft sampled as `index` from `probs` over the draft vocabulary -> its token id and its q over the
        whole vocabulary (0 outside the draft vocabulary), the q the accept test must use."""
        if self.draft_vocab is None:
            return index, probs
        full = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        return self.draft_vocab[index], full.index_copy(-1, self.draft_vocab, probs)

    def mtp_hidden_states(
        self,
        depth: int,
        token_ids: torch.Tensor,
        previous_hidden: torch.Tensor,
        layout: PassLayout,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tiers=None,
    ) -> torch.Tensor:
        """Runs the module for draft depth `depth` (1-based); depths past the last module reuse it."""
        module = self.mtp[min(depth, len(self.mtp)) - 1]
        return module(self.embed(token_ids), previous_hidden, layout, key_cache, value_cache, tiers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings in the model's dtype (a packed table widens its rows to float32)."""
        return self.embed_tokens(token_ids).to(self.norm.weight.dtype)
