"""Target/draft distributions and lossless speculative sampling (Leviathan et al.).

Greedy rows (temperature 0) use one-hot distributions, which makes the same rejection rule exact
argmax matching, so greedy and sampled requests share one code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rng


def _per_row(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return value.view(value.shape[0], *([1] * (like.dim() - 1)))


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """logits [B, ..., V] and per-row parameters [B] -> probabilities [B, ..., V] (float32).

    Top-k / top-p need the vocabulary sorted, the costliest op of a step on CPU, so on CPU the sort runs only
    when a sampled row truncates (a branch inside the graph, torch.cond); on a GPU a branch on tensor data
    would be a host sync, so the sort always runs there."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature == 0
    scaled = logits / _per_row(torch.where(temperature > 0, temperature, 1.0), logits)
    operands = (scaled, _per_row(top_k, logits), _per_row(top_p, logits))
    if logits.device.type != "cpu":
        probs = _truncated_probs(*operands)
    else:
        truncates = (~greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))).any()
        if torch.compiler.is_compiling():
            probs = torch.cond(truncates, _truncated_probs, _untruncated_probs, operands)
        else:
            probs = _truncated_probs(*operands) if truncates else _untruncated_probs(*operands)
    one_hot = F.one_hot(logits.argmax(-1), vocab).float()
    return torch.where(_per_row(greedy, logits), one_hot, probs)


def _truncated_probs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """softmax over the tokens top_k (0: all) and then top_p keep; top_k, top_p broadcast against scaled."""
    vocab = scaled.shape[-1]
    sorted_logits = scaled.sort(dim=-1, descending=True).values
    keep_top = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    ranks = torch.arange(vocab, device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= keep_top, float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    kept = ((mass_before < top_p) & (ranks < keep_top)).sum(-1, keepdim=True).clamp(min=1)
    kept = torch.where(top_p >= 1, keep_top.expand_as(kept), kept)
    threshold = sorted_logits.gather(-1, kept - 1)
    return scaled.masked_fill(scaled < threshold, float("-inf")).softmax(-1)


def _untruncated_probs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """What _truncated_probs gives when no row truncates."""
    return scaled.softmax(-1)


def race(probs: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The exponential race's scores p / -log u over probs [..., V]: its argmax is a sample from probs, its order a
    draw without replacement."""
    return probs / -torch.log(rng.uniforms(key, probs.shape[-1]))


def race_sample(probs: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Sample from probs [..., V] by the exponential race argmax(p / -log u); key [...] -> token ids [...]."""
    return race(probs, key).argmax(-1)


def verify_drafts(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    seeds: torch.Tensor,
    first_position: torch.Tensor,
    draft_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling over k drafts.

    target_probs [B, k+1, V] at the draft positions plus one; draft_probs [B, k, V]; draft_tokens [B, k];
    first_position [B]: position of the first draft token; draft_counts [B] (default k): the row's drafts at
    and past this index are rejected, so the row is verified exactly as if it had drafted only that many.
    Returns (accepted count n [B], next token [B]): the token drawn at index n, from the residual
    norm(max(p - q, 0)) after a rejection or from p when all valid drafts were accepted.
    """
    batch, width, vocab = target_probs.shape
    k = width - 1
    offsets = torch.arange(width, device=target_probs.device)
    positions = first_position[:, None] + offsets
    if k > 0:
        p_draft = target_probs[:, :k].gather(-1, draft_tokens[:, :, None])[..., 0]
        q_draft = draft_probs.gather(-1, draft_tokens[:, :, None])[..., 0]
        u = rng.uniform(rng.stream_key(seeds[:, None], positions[:, :k], rng.ACCEPT))
        accepted = u * q_draft < p_draft
        if draft_counts is not None:
            accepted = accepted & (offsets[None, :k] < draft_counts[:, None])
        n = accepted.long().cumprod(1).sum(1)
        q_padded = F.pad(draft_probs, (0, 0, 0, 1))
    else:
        n = torch.zeros(batch, dtype=torch.long, device=target_probs.device)
        q_padded = torch.zeros_like(target_probs)
    pick = n[:, None, None].expand(batch, 1, vocab)
    p_n = target_probs.gather(1, pick)[:, 0]
    q_n = q_padded.gather(1, pick)[:, 0]
    if draft_counts is not None:  # n reached the valid count: no draft there, the token comes from p
        q_n = torch.where((n < draft_counts)[:, None], q_n, 0.0)
    residual = (p_n - q_n).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)
    position_n = first_position + n
    next_token = race_sample(residual, rng.stream_key(seeds, position_n, rng.TARGET))
    return n, next_token
