"""n-gram drafts (prompt lookup): a request's own tokens propose its next ones, with tensor ops inside the step.

DecodeState.token_history holds every committed token t_0..t_{L-1} of a slot at its position. To draft, the last n
committed tokens are looked up earlier in the same history, for each n of the drafter's sizes, longest first. Of the
longest n that occurs, the latest occurrence that k committed tokens follow proposes those k tokens; if none does,
the latest occurrence proposes what follows it up to t_{L-1}. A lane with no occurrence drafts nothing (its draft
count is 0, so verification rejects its padded drafts).

The drafter is deterministic: its draft distribution q is one-hot at the proposed token. The rejection rule of
sampler.verify_drafts is then exact for it: a draft x is accepted with probability p(x), and after a rejection the
token comes from norm(max(p - q, 0)), which is p without x, renormalized. Greedy rows accept exactly the argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The n-gram lengths tried, longest first (docs/drafters.md measures the choice).
SIZES = (3, 2, 1)


def record_tokens(history: torch.Tensor, rows: torch.Tensor, first_position: torch.Tensor, tokens: torch.Tensor,
                  counts: torch.Tensor) -> None:
    """Writes the first counts [B] of tokens [B, W] into history's rows at first_position [B] onward; other writes
    (past a row's count, or past the history) land in the history's last column, which no lookup reads."""
    width = history.shape[1]
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    positions = first_position[:, None] + offsets
    positions = torch.where((offsets[None, :] < counts[:, None]) & (positions < width - 1), positions, width - 1)
    history.index_put_((rows[:, None], positions), tokens)


def propose(history: torch.Tensor, seq_lens: torch.Tensor, k: int, sizes: tuple[int, ...] = SIZES):
    """Drafts for rows whose committed tokens are history [B, C]'s first seq_lens [B]: tokens [B, k] and how many of
    them are proposals [B] (0..k; the tokens past that count are padding)."""
    width = history.shape[1]
    positions = torch.arange(width, device=history.device)
    last = (seq_lens - 1).clamp(min=0)
    best_end = torch.full_like(seq_lens, -1)
    for size in sorted(sizes):  # longer sizes found later replace shorter ones
        # An occurrence ending at j: history[j - i] == history[last - i] for i < size, with j - size + 1 >= 0 and
        # j < last (at least one committed token follows it).
        match = (positions[None, :] >= size - 1) & (positions[None, :] < last[:, None]) & (last[:, None] >= size - 1)
        for i in range(size):
            shifted = F.pad(history, (i, 0), value=-1)[:, :width]  # shifted[:, j] = history[:, j - i]
            suffix = history.gather(1, (last - i).clamp(min=0)[:, None])
            match = match & (shifted == suffix)
        # The latest occurrence that k committed tokens follow, else the latest (in a run of one token, the latest
        # occurrence ends just before the last token and would propose one).
        full = torch.where(match & (positions[None, :] <= (last - k)[:, None]), positions[None, :], -1).amax(1)
        end = torch.where(full >= 0, full, torch.where(match, positions[None, :], -1).amax(1))
        best_end = torch.where(end >= 0, end, best_end)
    found = best_end >= 0
    follow = (best_end[:, None] + 1 + torch.arange(k, device=history.device)).clamp(0, width - 1)
    tokens = history.gather(1, follow)
    counts = torch.where(found, (last - best_end).clamp(max=k), 0)
    return torch.where(torch.arange(k, device=history.device)[None, :] < counts[:, None], tokens, 0), counts


def draft_distribution(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q of deterministic drafts [B, k]: one-hot at each token [B, k, V]."""
    return F.one_hot(tokens, vocab_size).float()
