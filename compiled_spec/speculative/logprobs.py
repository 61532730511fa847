"""Log-probabilities of the emitted tokens, from the verify pass the step runs anyway.

Every emitted token, whether an accepted draft, the token drawn after a rejection or the bonus token, is predicted by
one row of the verify pass: emitted token j by row j (the pending token's row predicts the first), and a bonus token
after a tree's leaf by that leaf's row. The distribution is the target's raw one, log_softmax of the logits before
temperature, top-k and top-p (vLLM's logprobs_mode "raw_logprobs"), so a token's log-probability does not depend on
how it was sampled, on k or on the drafts.
"""

from __future__ import annotations

import torch

from .state import DecodeState


def write_logprobs(state: DecodeState, rows: torch.Tensor, logits: torch.Tensor, source_rows: torch.Tensor,
                   tokens: torch.Tensor) -> None:
    """logits [B, R, V] of a pass; tokens [B, W] emitted, token j predicted by row source_rows[:, j] [B, W]. Writes
    their log-probabilities and the state's N most likely tokens at each into the step_* logprob fields of rows."""
    batch, width = tokens.shape
    picked = logits.gather(1, source_rows[:, :, None].expand(batch, width, logits.shape[-1]))
    logprobs = picked.float().log_softmax(-1)
    top = logprobs.topk(state.step_top_ids.shape[-1], dim=-1)
    columns = torch.arange(width, device=rows.device)
    state.step_logprobs.index_put_((rows[:, None], columns[None, :]), logprobs.gather(-1, tokens[:, :, None])[..., 0])
    state.step_top_logprobs.index_put_((rows[:, None], columns[None, :]), top.values)
    state.step_top_ids.index_put_((rows[:, None], columns[None, :]), top.indices)
