"""Token trees: at each draft depth the main model verifies the draft module's top candidates, not only its one draft.

A tree is a tuple of widths, one per depth: (2, 2, 1) verifies at depth 1 the chain's draft and one more candidate,
at depth 2 the same, at depth 3 the chain's draft alone. The first candidate of each depth continues the chain; the
others are leaves, children of the chain's node one depth up. All candidates of a depth come from that depth's one
draft distribution q, so a tree costs the drafting a chain of the same depth costs, plus verify rows.

Candidates are drawn without replacement from q: for sampled rows the exponential race that draws the chain's draft
ranks the rest (its top candidates are an ordered draw without replacement); greedy rows take the draft logits' top.
Verification at a depth is recursive rejection sampling without replacement (Jeon et al. 2024, "Recursive Speculative
Decoding"; SpecInfer's multi-candidate rule with candidates drawn without replacement): candidate i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); after a rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} is q_i without
x_i, renormalized. The token drawn when every candidate is rejected comes from the last p. A candidate q gives no mass
(its q_i ran out) is never accepted and leaves p and q as they were: a proposal that proposes nothing. Greedy rows
accept the candidate equal to the target's argmax. The first candidate's test is the chain's test, so a tree whose
widths are all 1 verifies exactly as the chain does.

A leaf's key and value are written to a scratch row of the main caches past every position (DecodeState
.scratch_row); it attends to its parent's prefix and to its own row. When a leaf is accepted, its rows are copied to
its position in every main layer (with HiSparse, its index key and its hot row follow, and the rejected draft's hot
row is emptied), and the draft-extend reads its hidden state: draft depths re-run over verified rows every step, so
their caches need no move.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rng
from .sampler import race, race_sample


def leaf_nodes(widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """The leaves as (depth index j, candidate index s >= 1), depth by depth: depth j+1's candidate s."""
    return [(depth, candidate) for depth, width in enumerate(widths) for candidate in range(1, width)]


def draft_candidates(
    probs: torch.Tensor, logits: torch.Tensor, key: torch.Tensor, greedy: torch.Tensor, extra: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft (what race_sample(probs, key) draws) and `extra` more candidates [B, extra], indices into probs'
    vocabulary: the race's next places for sampled rows, the logits' next highest for greedy rows."""
    scores = race(probs, key)
    index = scores.argmax(-1)
    scores = torch.where(greedy[:, None], logits.float(), scores)
    scores = scores.scatter(-1, index[:, None], float("-inf"))
    return index, scores.topk(extra, dim=-1).indices


def leaf_key(accept_key: torch.Tensor, candidate: int) -> torch.Tensor:
    """The accept test's key for candidate `candidate` >= 1 of a depth (candidate 0 uses the chain's key)."""
    return rng.mix32(accept_key ^ rng.mix32(torch.full_like(accept_key, 0x68E31DA4 + candidate)))


def leaf_rows(state, nodes: list[tuple[int, int]], batch_size: int, first_row: torch.Tensor):
    """The leaves' rows of a verify pass whose chain starts at first_row [B]: their tokens [B, N] (from
    state.draft_leaves), positions [B, N], and the scratch rows [N] their keys and values go to."""
    per_depth = state.draft_leaves.shape[2]
    tokens = state.draft_leaves[:batch_size].flatten(1)[:, [j * per_depth + s - 1 for j, s in nodes]]
    depths = torch.tensor([j + 1 for j, _ in nodes], device=first_row.device)
    scratch = torch.tensor([state.scratch_row(j, s) for j, s in nodes], device=first_row.device)
    return tokens, first_row[:, None] + depths, scratch


def tree_layout(layout, scratch: torch.Tensor, active: torch.Tensor, capacity: int):
    """A verify pass's PassLayout over the chain's rows and then len(scratch) leaves: an active row's leaves write to
    their scratch rows; a chain row attends to every position up to its own, a leaf to the positions before its own
    (its parent's prefix) and to its scratch row."""
    positions = layout.positions
    is_leaf = torch.arange(positions.shape[1], device=positions.device) >= positions.shape[1] - scratch.shape[0]
    write_index = torch.where(is_leaf & active[:, None], F.pad(scratch, (positions.shape[1] - scratch.shape[0], 0)),
                              layout.write_index)
    cache_positions = torch.arange(capacity, device=positions.device)[None, None, :]
    limit = torch.where(is_leaf[None, :], positions - 1, positions)
    own = torch.where(is_leaf[None, :], write_index, -1)
    attend = ((cache_positions <= limit[:, :, None]) | (cache_positions == own[:, :, None]))[:, None]
    return layout._replace(write_index=write_index, attend=attend)


def end_on_leaf(state, rows, chain_hidden, leaf_hidden, accepted, on_leaf, leaf, first_row, scratch, attention,
                tiers) -> torch.Tensor:
    """Where a row's path ends on a leaf (on_leaf [B], its index `leaf` [B]): copies the leaf's key and value rows from
    its scratch row to its position in every main layer (and has the attention backend follow: HiSparse's index keys
    and hot rows), and returns the chain's hidden states [B, k+1, H] with the leaf's in its place (the draft-extend
    reads them)."""
    trash = state.trash_position
    source = torch.where(on_leaf, scratch[leaf], trash)
    target = torch.where(on_leaf, first_row + accepted, trash)
    for cache in state.main_keys + state.main_values:
        cache.index_put_((rows, target), cache[rows, source])
    attention.after_row_moved(state, tiers, rows, source, target)
    chosen = leaf_hidden.gather(1, leaf[:, None, None].expand(-1, 1, leaf_hidden.shape[-1]))
    offsets = torch.arange(chain_hidden.shape[1], device=rows.device)
    return torch.where(((offsets[None, :] == accepted[:, None]) & on_leaf[:, None])[..., None], chosen, chain_hidden)


def verify_tree(
    target_probs: torch.Tensor,
    leaf_target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    leaves: torch.Tensor,
    widths: tuple[int, ...],
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    first_position: torch.Tensor,
    draft_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over a tree of k = len(widths) depths.

    target_probs [B, k+1, V] at the pending token and the chain's drafts; leaf_target_probs [B, N, V] at the leaves
    (leaf_nodes order); draft_probs [B, k, V] (each depth's q); draft_tokens [B, k], the chain; leaves [B, N] their
    tokens; greedy [B]; first_position [B], the first draft's position; draft_counts [B] (default k): depths at and
    past it hold no drafts. Returns (accepted drafts n [B], next token [B], whether the n-th accepted draft is a leaf
    [B], that leaf's index in leaf_nodes [B]).
    """
    batch, width, vocab = target_probs.shape
    k = width - 1
    counts = torch.full_like(first_position, k) if draft_counts is None else draft_counts.clamp(max=k)
    nodes = leaf_nodes(widths)
    chain_accepted, leaf_taken, leaf_index, residuals = [], [], [], []
    for depth in range(k):
        has_drafts = depth < counts
        p, q = target_probs[:, depth], draft_probs[:, depth]
        key = rng.stream_key(seeds, first_position + depth, rng.ACCEPT)
        chain = draft_tokens[:, depth, None]
        p_chain, q_chain = p.gather(-1, chain)[:, 0], q.gather(-1, chain)[:, 0]
        chain_accepted.append(has_drafts & (rng.uniform(key) * q_chain < p_chain))
        p, q = _after_rejection(p, q, chain, has_drafts & ~greedy)
        taken = torch.zeros_like(has_drafts)
        index = torch.zeros_like(first_position)
        for node, (node_depth, candidate) in enumerate(nodes):
            if node_depth != depth:
                continue
            token = leaves[:, node, None]
            p_leaf, q_leaf = p.gather(-1, token)[:, 0], q.gather(-1, token)[:, 0]
            proposed = has_drafts & ~taken
            sampled_test = (q_leaf > 0) & (rng.uniform(leaf_key(key, candidate)) * q_leaf < p_leaf)
            accept = proposed & torch.where(greedy, p_leaf > 0, sampled_test)
            index = torch.where(accept, node, index)
            taken = taken | accept
            p, q = _after_rejection(p, q, token, proposed & ~accept & ~greedy & (q_leaf > 0))
        leaf_taken.append(taken)
        leaf_index.append(index)
        residuals.append(p)

    n = torch.stack(chain_accepted, 1).long().cumprod(1).sum(1)  # chain_accepted holds has_drafts
    # The token after the accepted path: from the bonus row when every draft was accepted, else from the residual at
    # the first rejected depth, unless a leaf there was accepted: then from the target at that leaf.
    next_probs = target_probs.gather(1, n[:, None, None].expand(batch, 1, vocab))[:, 0]
    ends_on_leaf = torch.zeros_like(n, dtype=torch.bool)
    leaf = torch.zeros_like(n)
    for depth in range(k):
        here = (n == depth) & (depth < counts)
        next_probs = torch.where(here[:, None], residuals[depth], next_probs)
        on_leaf = here & leaf_taken[depth]
        ends_on_leaf = ends_on_leaf | on_leaf
        leaf = torch.where(on_leaf, leaf_index[depth], leaf)
    if nodes:
        leaf_probs = leaf_target_probs.gather(1, leaf[:, None, None].expand(batch, 1, vocab))[:, 0]
        next_probs = torch.where(ends_on_leaf[:, None], leaf_probs, next_probs)
    n = n + ends_on_leaf.long()
    next_token = race_sample(next_probs, rng.stream_key(seeds, first_position + n, rng.TARGET))
    return n, next_token, ends_on_leaf, leaf


def _after_rejection(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor, rejected: torch.Tensor):
    """Where `rejected`: p <- norm(max(p - q, 0)) and q <- q without `token`, renormalized; elsewhere unchanged. p
    equal to q rejects nothing, so a residual without mass is never drawn from: p is kept there."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
    remaining = q.scatter(-1, token, 0.0)
    left = remaining.sum(-1, keepdim=True)
    remaining = torch.where(left > 0, remaining / left.clamp(min=1e-30), 0.0)
    return torch.where(rejected[:, None], residual, p), torch.where(rejected[:, None], remaining, q)
