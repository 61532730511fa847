"""Grammar token masks inside the step: structured output (engine/structured_output.py fills them on the host).

DecodeState.token_masks holds, per slot and verify row, a bitmask of the tokens the request's grammar allows there
(xgrammar's layout: bit b of int32 word w allows token 32 w + b; a lane without a grammar has every bit set). The
step masks the logits it samples from at every verify row, and prefill at the first token, before temperature,
top-k and top-p, so each row samples from the target masked exactly as plain masked decoding would. The masks are an
input tensor of the compiled step: a new grammar changes their values, never the graph.

The drafts are the drafter's, except where the grammar forces a token (the host drafts it, with a one-hot q).
Rejection sampling is lossless for any draft distribution, and a draft the grammar refuses has probability 0 under
the masked target, so it is always rejected (greedy: never the argmax); the rows after it are never reached.
"""

from __future__ import annotations

import torch

ALL_TOKENS = -1  # an int32 word with every bit set


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """masks [..., words] int32 -> allowed [..., vocab_size] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=masks.device)
    return ((masks[..., None] >> bits) & 1).bool().flatten(-2)[..., :vocab_size]


def mask_logits(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the tokens masks [..., words] refuse at -inf."""
    return logits.masked_fill(~allowed_tokens(masks, logits.shape[-1]), float("-inf"))
