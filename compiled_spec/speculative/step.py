"""The speculative step and prefill: pure functions of (model weights, DecodeState).

Positions: committed tokens are t_0..t_{L-1} (L = seq_lens); the main KV cache holds 0..L-2 and
t_{L-1} is the pending token. A step verifies [t_{L-1}, d_1..d_k] at positions L-1..L-1+k, accepts
n drafts and one more token, so L' = L + n + 1, then drafts t_{L'}..t_{L'+k-1} for the next step.
The state has K >= k draft slots and each step is compiled for its own k: k can change between steps
(engine/draft_chooser.py) because a row's drafts past its draft_counts are rejected, never verified. A step that
drafts k runs depths 1..k only (a k=0 step is plain decoding), so it costs what a K=k engine's step costs. Depths
past k leave this step's rows unwritten: when a later step drafts more, those depths attend over stale rows, which
can lower their acceptance but never changes an output (verification is lossless whatever the drafts are).

Draft depth m row i pairs h^{m-1}_i with t_{i+m} (h^0 is the main model's hidden state). Each depth
has its own KV cache. After verification, depth m re-runs rows L-m .. L-1+k (the "draft-extend"
window, width k+m), so every row whose inputs are all verified is (re)written from verified values,
and rows that used a draft token are rewritten next step before anything reads them.

With constants.drafter "ngram" the drafts come from the request's own tokens (speculative/ngram.py) instead of draft
depths: the step records its emitted tokens in state.token_history, looks the last ones up there, and sets each lane's
draft count to what its match proposes (0 without one). Their q is one-hot, so verification is unchanged.

A step called with tree=True verifies the token tree of constants.draft_tree (speculative/tree.py; k is its depth):
each depth's other candidates are extra rows of the verify pass, and the accepted path may end on one of them. Every
step with k > 0 drafts the tree's candidates, so a chain step and a tree step can follow each other (k = auto).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..model.causal_lm import CausalLM
from ..model.layers import PassLayout
from . import ngram, rng
from .logprobs import write_logprobs
from .attention_backend import AttentionBackend, DenseAttention
from .sampler import race_sample, sampling_probs, verify_drafts
from .state import DecodeState
from .token_masks import mask_logits
from .tree import draft_candidates, end_on_leaf, leaf_nodes, leaf_rows, tree_layout, verify_tree


class StepConstants(NamedTuple):
    """Values fixed for an engine's lifetime that the step reads."""

    rope_cos: torch.Tensor  # [capacity, rotary_dim]
    rope_sin: torch.Tensor
    eos_ids: torch.Tensor  # [num_eos] int64
    max_seq_len: int
    opaque_attention: bool = False
    attention: AttentionBackend = DenseAttention()  # HiSparseAttention: decode passes attend over tiered caches
    draft_tree: tuple[int, ...] = ()  # widths per depth (speculative/tree.py); a step with tree=True verifies it
    drafter: str = "mtp"  # "mtp": the MTP modules draft; "ngram": the request's own tokens do (speculative/ngram.py)


class Drafts(NamedTuple):
    """What a step verifies and drafts: a chain of k drafts, or with tree the token tree (k: its depth)."""

    k: int
    tree: bool = False

    def __str__(self) -> str:
        return f"tree k={self.k}" if self.tree else f"k={self.k}"


def make_layout(
    state: DecodeState,
    constants: StepConstants,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    writable: torch.Tensor,
    slots_are_prefix: bool,
    sparse: bool = False,
    attended: int | None = None,
) -> PassLayout:
    """Rows at `positions` [B, T]; rows that are not `writable` or lie before position 0 write to the trash.

    sparse: a decode pass, which attends sparsely when HiSparse is on (prefill stays dense).
    attended: no row lies at this position or past it (a prefill's rows lie within its prompt), so attention reads
    only the cache positions before it; default, the whole cache.
    """
    clamped = positions.clamp(min=0)
    write_index = torch.where(writable & (positions >= 0), positions, state.trash_position)
    cache_positions = torch.arange(state.cache_capacity if attended is None else attended, device=positions.device)
    attend = (cache_positions[None, None, :] <= clamped[:, :, None])[:, None]
    return PassLayout(
        slot_ids=slot_ids,
        write_index=write_index,
        attend=attend,
        cos=constants.rope_cos[clamped],
        sin=constants.rope_sin[clamped],
        slots_are_prefix=slots_are_prefix,
        opaque_attention=constants.opaque_attention,
        hisparse=constants.attention.config if sparse else None,
        positions=clamped,
    )


def max_drafts(state: DecodeState) -> int:
    """K: the state's draft slots, the most drafts a step over it can make."""
    return state.draft_tokens.shape[1]


def check_draft_length(state: DecodeState, k: int) -> None:
    if not 0 <= k <= max_drafts(state):
        raise ValueError(f"k={k} is out of range; this state has 0..{max_drafts(state)} draft slots")


def check_tree_step(constants: StepConstants, k: int, tree: bool) -> None:
    if tree and k != len(constants.draft_tree):
        raise ValueError(f"a tree step drafts the tree's depth: k={k}, but the token tree {constants.draft_tree} is "
                         f"{len(constants.draft_tree)} deep")


def state_writes(state: DecodeState, constants: StepConstants, k: int) -> tuple[str, ...]:
    """The DecodeState fields the step or prefill drafting k updates (checked by passes/state_mutation)."""
    depths = k if constants.drafter == "mtp" else 0
    names = ["pending_tokens", "seq_lens", "generated", "done", "step_tokens", "step_emitted", "step_accepted",
             "step_verified", "step_on_leaf"]
    names += [f"main_keys[{i}]" for i in range(len(state.main_keys))]
    names += [f"main_values[{i}]" for i in range(len(state.main_values))]
    if max_drafts(state) > 0:
        names.append("draft_counts")
    if k > 0:
        names += ["draft_tokens"] + (["draft_probs"] if depths else [])
        names += [f"draft_keys[{i}]" for i in range(depths)] + [f"draft_values[{i}]" for i in range(depths)]
    if state.token_history is not None:
        names.append("token_history")
    if state.step_logprobs is not None:
        names += ["step_logprobs", "step_top_logprobs", "step_top_ids"]
    if depths > 1:
        names.append("carry_hidden")
    if k > 0 and state.draft_leaves is not None:
        names.append("draft_leaves")
    return tuple(names + constants.attention.state_writes(state, depths))


def _row_params(state: DecodeState, rows: torch.Tensor):
    return state.temperature[rows], state.top_k[rows], state.top_p[rows]


def _draft_chain(
    model: CausalLM,
    state: DecodeState,
    constants: StepConstants,
    slot_ids: torch.Tensor,
    slots_are_prefix: bool,
    first_row: torch.Tensor,
    window_tokens: torch.Tensor,
    main_hidden: torch.Tensor,
    carry_hidden: torch.Tensor | None,
    producing_index: torch.Tensor,
    writable_rows: torch.Tensor,
    next_position: torch.Tensor,
    k: int,
    sparse: bool = False,
    attended: int | None = None,
):
    """Runs draft depths 1..k over their windows and samples one draft at each.

    first_row [B]: row of window index 0 at depth 1 (depth m starts at first_row - m + 1).
    window_tokens [B, W + k]: token t_{first_row + 1 + j} at index j; drafts are written in as they are made.
    main_hidden [B, W, H]: h^0 at rows first_row .. first_row + W - 1.
    carry_hidden [B, >= k-1, H] or None: h^d at row first_row - d, the extra row depth d+1 needs in front.
    producing_index [B]: depth-1 window index whose output predicts the first draft (n in a step).
    writable_rows [B, W]: depth-1 rows that may be written (prompt padding may not).
    next_position [B]: position of the first draft token.
    attended: as make_layout's (a prefill's prompt width).
    Returns draft tokens [B, k], draft probs [B, k, V], new carry [B, k-1, H] (depth d output at
    producing_index), and with a tree's leaf slots in the state, each depth's next candidates [B, k, leaves].
    """
    batch, width, _ = main_hidden.shape
    rows = slot_ids
    temperature, top_k, top_p = _row_params(state, rows)
    seeds = state.seeds[rows]
    offsets = torch.arange(width + k, device=main_hidden.device)
    previous = main_hidden
    leaves_per_depth = state.draft_leaves.shape[2] if state.draft_leaves is not None else 0
    drafts, probs, carries, leaves = [], [], [], []
    for depth in range(1, k + 1):
        window = width + depth - 1
        start = first_row - (depth - 1)
        positions = start[:, None] + offsets[:window]
        # Depth m row i reads t_{i+m}: window index j holds row start + j, token index j + m - 1 - (m - 1) = j.
        tokens = window_tokens[:, :window]
        writable = torch.cat([torch.ones_like(writable_rows[:, :1]).expand(batch, depth - 1), writable_rows], dim=1)
        layout = make_layout(state, constants, slot_ids, positions, writable, slots_are_prefix, sparse, attended)
        if depth > 1:
            previous = _prepend_row(carry_hidden[:, depth - 2 : depth - 1], previous)
        tiers = constants.attention.draft_tiers(state, depth)
        hidden = model.mtp_hidden_states(
            depth, tokens, previous, layout, state.draft_keys[depth - 1], state.draft_values[depth - 1], tiers
        )
        constants.attention.after_draft_pass(state, tiers, depth, layout, slot_ids)
        pick = (producing_index + depth - 1)[:, None, None].expand(batch, 1, hidden.shape[-1])
        logits = model.draft_logits(hidden.gather(1, pick)[:, 0])
        depth_probs = sampling_probs(logits, temperature, top_k, top_p)
        position = next_position + depth - 1
        key = rng.stream_key(seeds, position, rng.DRAFT + depth)
        if leaves_per_depth:
            index, others = draft_candidates(depth_probs, logits, key, temperature == 0, leaves_per_depth)
            leaves.append(model.draft_token_ids(others))
        else:
            index = race_sample(depth_probs, key)
        token, depth_probs = model.draft_tokens_and_probs(index, depth_probs)
        window_tokens = torch.where(offsets[None, :] == producing_index[:, None] + depth, token[:, None],
                                    window_tokens)
        drafts.append(token)
        probs.append(depth_probs)
        if depth < k:
            # The row the next step's depth depth+1 window needs in front: index n of this depth's window.
            carry_pick = producing_index[:, None, None].expand(batch, 1, hidden.shape[-1])
            carries.append(hidden.gather(1, carry_pick)[:, 0])
        previous = hidden
    carry = _stack_in_one_kernel(carries) if carries else None
    leaf_tokens = _stack_in_one_kernel(leaves) if leaves else None
    return _stack_in_one_kernel(drafts), _stack_in_one_kernel(probs), carry, leaf_tokens


# A cat or stack of values computed after different attention calls is one buffer whose slices inductor's graph
# partitions (piecewise on CUDA) may each allocate on their own, losing a slice (passes/partition_cat.py). These build
# the same values with pointwise ops, which inductor computes in one kernel that reads every piece.


def _prepend_row(row: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """torch.cat([row, rows], dim=1) of row [B, 1, H] and rows [B, W, H]."""
    index = torch.arange(rows.shape[1] + 1, device=rows.device)[None, :, None]
    return torch.where(index == 0, row, F.pad(rows, (0, 0, 1, 0)))


def _stack_in_one_kernel(pieces: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(pieces, dim=1)."""
    first = pieces[0].unsqueeze(1)
    index = torch.arange(len(pieces), device=first.device).view(1, -1, *([1] * (first.dim() - 2)))
    stacked = first.expand(first.shape[0], len(pieces), *first.shape[2:])
    for position, piece in enumerate(pieces[1:], start=1):
        stacked = torch.where(index == position, piece.unsqueeze(1), stacked)
    return stacked


def _stop_count(tokens, emitted, eos_ids, ignore_eos, generated, max_new_tokens, seq_lens, max_seq_len):
    """Truncate `emitted` [B] tokens of `tokens` [B, W] at the first EOS and at the length limits.

    Returns (count [B], finished [B]).
    """
    width = tokens.shape[1]
    offsets = torch.arange(width, device=tokens.device)
    is_eos = (tokens[:, :, None] == eos_ids).any(-1) & (offsets < emitted[:, None]) & ~ignore_eos[:, None]
    first_eos = torch.where(is_eos, offsets, width).min(1).values
    budget = torch.minimum(max_new_tokens - generated, max_seq_len - seq_lens)
    count = torch.minimum(torch.minimum(emitted, first_eos + 1), budget.clamp(min=0))
    finished = (first_eos < count) | (count >= budget)
    return count, finished


def _write_rows(buffer: torch.Tensor, rows: torch.Tensor, value: torch.Tensor) -> None:
    buffer.index_copy_(0, rows, value.to(buffer.dtype))


def _write_leading(buffer: torch.Tensor, rows: torch.Tensor, value: torch.Tensor) -> None:
    """Writes value [B, n, ...] into the first n columns of buffer's rows; the other columns keep their values."""
    if value.shape[1] == buffer.shape[1]:
        _write_rows(buffer, rows, value)
        return
    columns = torch.arange(value.shape[1], device=rows.device)
    buffer.index_put_((rows[:, None], columns[None, :]), value.to(buffer.dtype))


def _write_chain(state: DecodeState, rows: torch.Tensor, chain: tuple, keep: torch.Tensor | None = None) -> None:
    """Writes what _draft_chain made (drafts, their probabilities, the carried hidden states, a tree's leaves; None:
    not made) into the first columns of rows; lanes where keep [B] is False (done lanes of a step) keep theirs."""
    buffers = (state.draft_tokens, state.draft_probs, state.carry_hidden, state.draft_leaves)
    for buffer, new in zip(buffers, chain):
        if new is None:
            continue
        if keep is not None:
            lanes = keep.view(-1, *[1] * (new.dim() - 1))
            new = torch.where(lanes, new, buffer[: new.shape[0], : new.shape[1]])
        _write_leading(buffer, rows, new)


def _write_results(state: DecodeState, rows: torch.Tensor, *, pending, seq_lens, generated, done, tokens, emitted,
                   accepted, verified, on_leaf) -> None:
    """Writes a pass's outcome for rows: the state it leaves and the step_* fields the host reads back (tokens
    [B, n] padded to the state's width)."""
    _write_rows(state.pending_tokens, rows, pending)
    _write_rows(state.seq_lens, rows, seq_lens)
    _write_rows(state.generated, rows, generated)
    _write_rows(state.done, rows, done)
    _write_rows(state.step_tokens, rows, F.pad(tokens, (0, state.step_tokens.shape[1] - tokens.shape[1])))
    _write_rows(state.step_emitted, rows, emitted)
    _write_rows(state.step_accepted, rows, accepted)
    _write_rows(state.step_verified, rows, verified)
    _write_rows(state.step_on_leaf, rows, on_leaf)


def speculative_step(model: CausalLM, state: DecodeState, constants: StepConstants, batch_size: int, k: int,
                     tree: bool = False) -> None:
    """One step for slots 0..batch_size-1 that verifies the drafts each slot holds (at most k; tree: with the token
    tree's other candidates) and then drafts k tokens; slots marked done are left unchanged."""
    check_draft_length(state, k)
    check_tree_step(constants, k, tree)
    slots = max_drafts(state)
    rows = torch.arange(batch_size, device=state.seq_lens.device)
    seq_lens = state.seq_lens[:batch_size]
    active = ~state.done[:batch_size]
    # Done rows (padding lanes) may hold a stale length up to max_seq_len + k: run them at position 0, writing nothing.
    first_row = torch.where(active, seq_lens - 1, 0)
    writable = active[:, None].expand(batch_size, k + 1)
    temperature, top_k, top_p = _row_params(state, rows)
    seeds = state.seeds[rows]

    drafts = state.draft_tokens[:batch_size, :k]
    verify_tokens = torch.cat([state.pending_tokens[:batch_size, None], drafts], dim=1)
    offsets = torch.arange(k + 1, device=rows.device)
    positions = first_row[:, None] + offsets
    widths = constants.draft_tree if tree else ()
    nodes = leaf_nodes(widths)
    if nodes:  # the leaves follow the chain's rows, each at its depth's position
        leaf_tokens, leaf_positions, scratch = leaf_rows(state, nodes, batch_size, first_row)
        verify_tokens = torch.cat([verify_tokens, leaf_tokens], dim=1)
        positions = torch.cat([positions, leaf_positions], dim=1)
    verify_writable = active[:, None].expand(batch_size, positions.shape[1])
    layout = make_layout(state, constants, rows, positions, verify_writable, True, sparse=True)
    if nodes:
        layout = tree_layout(layout, scratch, active, state.cache_capacity)
    tiers = constants.attention.main_tiers(state)
    hidden = model.hidden_states(verify_tokens, layout, state.main_keys, state.main_values, tiers)
    constants.attention.after_main_pass(state, tiers, layout, rows)
    logits = model.logits(hidden)
    sampled_logits = logits
    if state.token_masks is not None:  # structured output refuses trees (config.py): the rows are the chain's k+1
        sampled_logits = mask_logits(logits, state.token_masks[:batch_size, : k + 1])
    target_probs = sampling_probs(sampled_logits, temperature, top_k, top_p)
    verified = state.draft_counts[:batch_size].clamp(max=k) if slots > 0 else None
    draft_probs = (state.draft_probs[:batch_size, :k] if constants.drafter == "mtp"
                   else ngram.draft_distribution(drafts, target_probs.shape[-1]))
    if nodes:
        accepted, next_token, on_leaf, leaf = verify_tree(
            target_probs[:, : k + 1], target_probs[:, k + 1 :], draft_probs, drafts, leaf_tokens,
            widths, temperature == 0, seeds, seq_lens, verified)
        hidden = end_on_leaf(state, rows, hidden[:, : k + 1], hidden[:, k + 1 :], accepted, on_leaf & active, leaf,
                             first_row, scratch, constants.attention, tiers)
    else:
        accepted, next_token = verify_drafts(target_probs, draft_probs, drafts, seeds, seq_lens,
                                             verified)

    # Emitted this step: d_1..d_n, then the residual/bonus token at index n.
    padded_drafts = F.pad(drafts, (0, 1))
    emitted_tokens = torch.where(offsets[None, :] < accepted[:, None], padded_drafts, 0)
    if nodes:  # the path's last draft is a leaf
        leaf_token = leaf_tokens.gather(1, leaf[:, None])
        emitted_tokens = torch.where((offsets[None, :] == accepted[:, None] - 1) & on_leaf[:, None], leaf_token,
                                     emitted_tokens)
    emitted_tokens = torch.where(offsets[None, :] == accepted[:, None], next_token[:, None], emitted_tokens)
    if state.step_logprobs is not None:  # emitted token j comes from row j; a bonus token after a leaf from its row
        source_rows = offsets[None, :].expand(batch_size, k + 1)
        if nodes:
            source_rows = torch.where((offsets[None, :] == accepted[:, None]) & on_leaf[:, None], k + 1 + leaf[:, None],
                                      source_rows)
        write_logprobs(state, rows, logits, source_rows, emitted_tokens)
    count, finished = _stop_count(
        emitted_tokens, accepted + 1, constants.eos_ids, state.ignore_eos[:batch_size],
        state.generated[:batch_size], state.max_new_tokens[:batch_size], seq_lens, constants.max_seq_len,
    )
    count = torch.where(active, count, 0)
    new_seq_lens = torch.where(active, seq_lens + accepted + 1, seq_lens)
    draft_counts = torch.full_like(count, k)
    if state.token_history is not None:
        ngram.record_tokens(state.token_history, rows, seq_lens, emitted_tokens, torch.where(active, accepted + 1, 0))

    if k > 0 and constants.drafter == "ngram":
        new_drafts, draft_counts = ngram.propose(state.token_history[:batch_size], new_seq_lens, k)
        _write_chain(state, rows, (new_drafts, None, None, None), keep=active)
    elif k > 0:
        window_tokens = F.pad(emitted_tokens, (0, k))
        new_drafts, new_probs, new_carry, new_leaves = _draft_chain(
            model, state, constants, rows, True,
            first_row=first_row,
            window_tokens=window_tokens,
            main_hidden=hidden,
            carry_hidden=state.carry_hidden[:batch_size],
            producing_index=accepted,
            writable_rows=writable,
            next_position=new_seq_lens,
            k=k,
            sparse=True,
        )
        _write_chain(state, rows, (new_drafts, new_probs, new_carry, new_leaves), keep=active)
    if slots > 0:
        counts = state.draft_counts[:batch_size]
        draft_counts = torch.minimum(draft_counts, state.draft_limits[:batch_size])
        _write_rows(state.draft_counts, rows, torch.where(active, draft_counts, counts))
    _write_results(state, rows, pending=torch.where(active, next_token, state.pending_tokens[:batch_size]),
                   seq_lens=new_seq_lens, generated=state.generated[:batch_size] + count,
                   done=state.done[:batch_size] | (active & finished), tokens=emitted_tokens, emitted=count,
                   accepted=torch.where(active, accepted, 0),
                   verified=torch.where(active, verified, 0) if slots > 0 else torch.zeros_like(count),
                   on_leaf=on_leaf & active if nodes else torch.zeros_like(active))


def prefill(
    model: CausalLM,
    state: DecodeState,
    constants: StepConstants,
    slot: torch.Tensor,
    prompt_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    k: int,
) -> None:
    """Fills slots [n] from prompt_ids [1, T] (the first prompt_len [1] tokens are real) and samples each one's
    first token and k drafts. n > 1: choices of one prompt (SamplingParams.n), which share the main model's pass: its
    KV rows go to slot[0] and are copied to the others; each choice samples with its own seed and drafts over its own
    first token. k = auto admits with the k it decodes with: draft depths past it then hold no rows of this prompt
    (0: a plain prefill, which runs no draft depth). Sampling parameters and limits of the slots are set
    beforehand."""
    check_draft_length(state, k)
    slots = max_drafts(state)
    choices, width = slot.shape[0], prompt_ids.shape[1]
    positions = torch.arange(width, device=prompt_ids.device)[None, :]
    real = positions < prompt_len[:, None]
    layout = make_layout(state, constants, slot[:1], positions, real, False, attended=width)
    constants.attention.reset_slot(state, slot[:1])
    hidden = model.hidden_states(prompt_ids, layout, state.main_keys, state.main_values,
                                 constants.attention.main_tiers(state))
    if choices > 1:
        for cache in state.main_keys + state.main_values:
            cache.index_copy_(0, slot[1:], cache[slot[:1]].expand(choices - 1, *cache.shape[1:]))
    lengths = prompt_len.expand(choices)
    last = (prompt_len - 1)[:, None, None].expand(1, 1, hidden.shape[-1])
    temperature, top_k, top_p = _row_params(state, slot)
    logits = model.logits(hidden.gather(1, last)[:, 0]).expand(choices, -1)
    sampled_logits = logits if state.token_masks is None else mask_logits(logits, state.token_masks[slot, 0])
    probs = sampling_probs(sampled_logits, temperature, top_k, top_p)
    seeds = state.seeds[slot]
    first_token = race_sample(probs, rng.stream_key(seeds, lengths, rng.TARGET))
    if state.step_logprobs is not None:
        write_logprobs(state, slot, logits[:, None], torch.zeros_like(slot)[:, None], first_token[:, None])
    new_seq_len = lengths + 1
    count, finished = _stop_count(
        first_token[:, None], torch.ones_like(lengths), constants.eos_ids, state.ignore_eos[slot],
        torch.zeros_like(lengths), state.max_new_tokens[slot], lengths, constants.max_seq_len,
    )

    draft_counts = torch.full_like(lengths, k)
    if state.token_history is not None:
        ngram.record_tokens(state.token_history, slot, torch.zeros_like(lengths), prompt_ids.expand(choices, -1),
                            lengths)
        ngram.record_tokens(state.token_history, slot, lengths, first_token[:, None], torch.ones_like(lengths))

    if k > 0 and constants.drafter == "ngram":
        drafts, draft_counts = ngram.propose(state.token_history[slot], new_seq_len, k)
        _write_chain(state, slot, (drafts, None, None, None))
    elif k > 0:
        # Depth-1 row i reads t_{i+1}: the prompt shifted by one, with the first token after it.
        shifted = F.pad(prompt_ids[:, 1:], (0, k + 1)).expand(choices, -1)
        offsets = torch.arange(shifted.shape[1], device=prompt_ids.device)
        window_tokens = torch.where(offsets[None, :] == (lengths - 1)[:, None], first_token[:, None], shifted)
        drafts, draft_probs, carry, leaves = _draft_chain(
            model, state, constants, slot, False,
            first_row=torch.zeros_like(lengths),
            window_tokens=window_tokens,
            main_hidden=hidden.expand(choices, -1, -1),
            carry_hidden=torch.zeros_like(state.carry_hidden[slot]),
            producing_index=lengths - 1,
            writable_rows=real.expand(choices, -1),
            next_position=new_seq_len,
            k=k,
            attended=width,
        )
        _write_chain(state, slot, (drafts, draft_probs, carry, leaves))
    if slots > 0:
        _write_rows(state.draft_counts, slot, torch.minimum(draft_counts, state.draft_limits[slot]))
    _write_results(state, slot, pending=first_token, seq_lens=new_seq_len, generated=count, done=finished,
                   tokens=first_token[:, None], emitted=count, accepted=torch.zeros_like(count),
                   verified=torch.zeros_like(count), on_leaf=torch.zeros_like(finished))
