"""DeepSeek-V3-style multi-token-prediction module.

Row i pairs the previous depth's hidden state h_i (the main model's, after its final norm, at depth 1)
with the embedding of token t_{i+depth}; its output, after post_norm (DeepSeek's shared_head.norm),
predicts t_{i+depth+1} through the main model's head and is the input hidden of the next depth.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import DecoderLayer, PassLayout, RMSNorm


class MtpModule(nn.Module):
    def __init__(self, config: ModelConfig, module_index: int, hidden_first: bool = False):
        super().__init__()
        hidden = config.hidden_size
        self.hidden_first = hidden_first
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DecoderLayer(config, config.num_hidden_layers + module_index)
        self.post_norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(
        self,
        token_embeds: torch.Tensor,
        previous_hidden: torch.Tensor,
        layout: PassLayout,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tiers=None,
    ) -> torch.Tensor:
        parts = [self.enorm(token_embeds), self.hnorm(previous_hidden)]
        if self.hidden_first:
            parts.reverse()
        x = self.eh_proj(torch.cat(parts, dim=-1))
        return self.post_norm(self.block(x, layout, key_cache, value_cache, tiers))
