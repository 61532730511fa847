"""What transformers computes for a token sequence: main-model logits and MTP chains built from MtpLayer."""

from __future__ import annotations

import torch


def causal_mask(length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive [1, 1, T, T] mask, read the same way by transformers' eager and sdpa attention."""
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(length, length, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)[None, None]


@torch.no_grad()
def main_hidden_and_logits(model, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Last hidden states after the final norm [1, T, H] and logits [T, V]."""
    out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.hidden_states[-1], out.logits[0]


@torch.no_grad()
def mtp_logits_per_depth(model, mtp_layers, token_ids: list[int], depths: int) -> list[torch.Tensor]:
    """Teacher-forced MTP logits for depths 1..depths: entry m-1 is [T - m, V], row i predicts token i+m+1.

    Depth m row i pairs the depth m-1 output at row i (the main model's post-norm hidden at depth 1)
    with the embedding of token i+m; depths past the last module reuse the last module.
    """
    ids = torch.tensor([token_ids])
    hidden, _ = main_hidden_and_logits(model, token_ids)
    base = model.model
    out = []
    for depth in range(1, depths + 1):
        rows = len(token_ids) - depth
        positions = torch.arange(rows)[None]
        cos, sin = base.rotary_emb(hidden, positions)
        layer = mtp_layers[min(depth, len(mtp_layers)) - 1]
        hidden = layer(
            inputs_embeds=base.embed_tokens(ids[:, depth:]),
            previous_hidden_state=hidden[:, :rows],
            position_embeddings=(cos, sin),
            attention_mask=causal_mask(rows),
            position_ids=positions,
            cache=None,
        )
        out.append(model.lm_head(hidden)[0])
    return out
