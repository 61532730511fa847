"""DecodeState: the one home of decode state.

Every value that can change between steps lives in one of these persistent tensors. The compiled
step reads them and mutates them in place; the engine (engine/engine.py) writes a slot's row only when it
admits or frees a request, between steps. Slot i is batch row i: active requests occupy slots 0..B-1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import torch

from ..config import ModelConfig
from ..hisparse.host_pool import pinned_host_caches
from ..hisparse.tiers import HiSparseState, allocate_tiers
from .token_masks import ALL_TOKENS, mask_words


@dataclass(eq=False)
class DecodeState:
    # The last committed token t_{L-1}, not yet in the main KV cache, and L = committed length.
    pending_tokens: torch.Tensor  # [slots] int64
    seq_lens: torch.Tensor  # [slots] int64
    # Drafts for the next step, t_L .. t_{L+K-1}, and the draft distributions they were sampled from. K is the
    # number of draft slots; a step that drafts k <= K of them fills the first k and sets draft_counts to k.
    draft_tokens: torch.Tensor  # [slots, K] int64
    draft_probs: torch.Tensor  # [slots, K, vocab] float32 ([slots, 0, vocab] for n-gram drafts: q is one-hot)
    # How many of a slot's drafts are valid: verification rejects every draft at or past this count.
    draft_counts: torch.Tensor  # [slots] int64
    # The most drafts a slot's request lets a step verify (its own k; K for the engine's): draft_counts never exceed it.
    draft_limits: torch.Tensor  # [slots] int64
    # Depth-d MTP hidden state at row L-d-1, for d = 1..K-1: the row before depth d+1's window.
    carry_hidden: torch.Tensor  # [slots, max(K-1, 0), hidden] (n-gram drafts: [slots, 0, hidden])
    generated: torch.Tensor  # [slots] int64, tokens emitted so far
    max_new_tokens: torch.Tensor  # [slots] int64
    done: torch.Tensor  # [slots] bool
    # Sampling parameters, per slot.
    temperature: torch.Tensor  # [slots] float32, 0 = greedy
    top_k: torch.Tensor  # [slots] int64, 0 = off
    top_p: torch.Tensor  # [slots] float32
    seeds: torch.Tensor  # [slots] int64
    ignore_eos: torch.Tensor  # [slots] bool
    # What the last call emitted, read by the host with one copy: tokens [slots, K+1], then counts.
    step_tokens: torch.Tensor  # [slots, K+1] int64
    step_emitted: torch.Tensor  # [slots] int64
    step_accepted: torch.Tensor  # [slots] int64
    step_verified: torch.Tensor  # [slots] int64: drafts the last step verified (its k, or fewer the slot held)
    step_on_leaf: torch.Tensor  # [slots] bool: the last step's accepted path ended on a token tree's leaf
    # KV caches [slots, capacity, kv_heads, head_dim]: one per main layer, one per draft depth.
    main_keys: list[torch.Tensor]
    main_values: list[torch.Tensor]
    draft_keys: list[torch.Tensor]
    draft_values: list[torch.Tensor]
    # Token trees (speculative/tree.py): each depth's other candidates after its draft, best first; None without a
    # tree. Their keys and values go to the scratch rows of the main caches (scratch_row).
    draft_leaves: torch.Tensor | None = None  # [slots, K, tree width - 1] int64
    # The n-gram drafter (speculative/ngram.py): every committed token t_0..t_{L-1} at its position; None with MTP
    # drafts. Its last column absorbs writes past the end.
    token_history: torch.Tensor | None = None  # [slots, capacity] int64
    # With logprobs on (EngineConfig.max_logprobs = N > 0), what the last call emitted under the target's raw
    # distribution: each step_tokens entry's log-probability, and the N most likely tokens there; None when off.
    step_logprobs: torch.Tensor | None = None  # [slots, K+1] float32
    step_top_logprobs: torch.Tensor | None = None  # [slots, K+1, N] float32
    step_top_ids: torch.Tensor | None = None  # [slots, K+1, N] int64
    # With structured output on (EngineConfig.structured_output), the tokens each verify row may sample, as bitmasks
    # the host writes before every step and prefill (speculative/token_masks.py); None when off.
    token_masks: torch.Tensor | None = None  # [slots, K+1, ceil(vocab / 32)] int32
    # HiSparse's tiers (compiled_spec/hisparse/tiers.py), one per main layer then one per draft depth; None when off.
    hisparse: HiSparseState | None = None

    @property
    def num_slots(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def cache_capacity(self) -> int:
        return self.main_keys[0].shape[1]

    @property
    def trash_position(self) -> int:
        """Cache position that absorbs writes that must not land anywhere; no query ever reaches it."""
        return self.cache_capacity - 1

    def scratch_row(self, depth: int, candidate: int) -> int:
        """The main caches' row for depth index `depth`'s candidate `candidate` >= 1 of a tree's verify pass: past
        every position a sequence reaches, before the trash position."""
        per_depth = self.draft_leaves.shape[2]
        return self.trash_position - self.draft_leaves.shape[1] * per_depth + depth * per_depth + candidate - 1

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor with the field it belongs to: ('seq_lens', ...), ('main_keys[0]', ...),
        ('hisparse.hot_keys[0]', ...), in field order."""
        return _named_tensors(self)

    def tensors(self) -> list[torch.Tensor]:
        return [tensor for _, tensor in self.named_tensors()]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "DecodeState":
        """A state of the same layout over `tensors`, given in tensors() order (the inverse of tensors())."""
        state, at = _with_tensors(self, tensors, 0)
        if at != len(tensors):
            raise ValueError(f"{len(tensors)} tensors for a state of {at}")
        return state

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_slots: int,
        max_seq_len: int,
        max_drafts: int,
        dtype: torch.dtype,
        device: str | torch.device,
        hot_rows: int | None = None,
        index_dims: list[int] | tuple[int, ...] = (),
        cold_dtype: torch.dtype | None = None,
        pinned_cold_pool: bool = False,
        tree_width: int = 1,
        drafter: str = "mtp",
        max_logprobs: int = 0,
        structured_output: bool = False,
    ) -> "DecodeState":
        """max_drafts: K, the draft slots (a step may draft fewer). hot_rows and index_dims (one per main layer, then
        per draft depth) turn on the HiSparse tiers; the KV caches are then their cold pool, in cold_dtype (default:
        dtype), and with pinned_cold_pool (CUDA) in pinned host memory. tree_width: the widest depth of a token tree the
        steps may verify (1: chains only). drafter: "mtp" (draft depths with their caches) or "ngram" (the token
        history instead). max_logprobs: N > 0 keeps each emitted token's log-probability and the N most likely
        tokens. structured_output: keeps grammar token masks for each verify row."""
        k = max_drafts
        depths = k if drafter == "mtp" else 0  # draft depths with KV caches and carried hidden states
        # Rows up to position max_seq_len - 1 + k are written by a step; then a tree's scratch rows; one more is the
        # trash position.
        leaves = tree_width - 1
        capacity = max_seq_len + k + k * leaves + 1
        cache_shape = (num_slots, capacity, config.num_key_value_heads, config.head_dim)

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        def caches(count):
            cache_dtype = cold_dtype if hot_rows and cold_dtype else dtype
            if hot_rows and pinned_cold_pool:
                return pinned_host_caches(cache_shape, cache_dtype, count, device)
            return [zeros(*cache_shape, dtype=cache_dtype) for _ in range(count)]

        return cls(
            pending_tokens=zeros(num_slots),
            seq_lens=torch.ones(num_slots, dtype=torch.int64, device=device),
            draft_tokens=zeros(num_slots, k),
            draft_probs=zeros(num_slots, depths, config.vocab_size, dtype=torch.float32),
            draft_counts=zeros(num_slots),
            draft_limits=torch.full((num_slots,), k, dtype=torch.int64, device=device),
            carry_hidden=zeros(num_slots, max(depths - 1, 0), config.hidden_size, dtype=dtype),
            generated=zeros(num_slots),
            max_new_tokens=zeros(num_slots),
            done=torch.ones(num_slots, dtype=torch.bool, device=device),
            temperature=zeros(num_slots, dtype=torch.float32),
            top_k=zeros(num_slots),
            top_p=torch.ones(num_slots, dtype=torch.float32, device=device),
            seeds=zeros(num_slots),
            ignore_eos=zeros(num_slots, dtype=torch.bool),
            step_tokens=zeros(num_slots, k + 1),
            step_emitted=zeros(num_slots),
            step_accepted=zeros(num_slots),
            step_verified=zeros(num_slots),
            step_on_leaf=zeros(num_slots, dtype=torch.bool),
            main_keys=caches(config.num_hidden_layers),
            main_values=caches(config.num_hidden_layers),
            draft_keys=caches(depths),
            draft_values=caches(depths),
            draft_leaves=zeros(num_slots, k, leaves) if leaves else None,
            token_history=zeros(num_slots, capacity) if drafter == "ngram" else None,
            step_logprobs=zeros(num_slots, k + 1, dtype=torch.float32) if max_logprobs else None,
            step_top_logprobs=zeros(num_slots, k + 1, max_logprobs, dtype=torch.float32) if max_logprobs else None,
            step_top_ids=zeros(num_slots, k + 1, max_logprobs) if max_logprobs else None,
            token_masks=torch.full((num_slots, k + 1, mask_words(config.vocab_size)), ALL_TOKENS, dtype=torch.int32,
                                   device=device) if structured_output else None,
            hisparse=allocate_tiers(hot_rows, index_dims, num_slots, capacity, *cache_shape[2:], dtype, device)
            if hot_rows else None,
        )


def _named_tensors(holder, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out = []
    for holder_field in fields(holder):
        name, value = prefix + holder_field.name, getattr(holder, holder_field.name)
        if is_dataclass(value):
            out += _named_tensors(value, f"{name}.")
        elif isinstance(value, list):
            out += [(f"{name}[{i}]", tensor) for i, tensor in enumerate(value)]
        elif value is not None:
            out.append((name, value))
    return out


def _with_tensors(holder, tensors: list[torch.Tensor], at: int):
    """A copy of holder (a dataclass of tensors, lists of them and dataclasses of those) over tensors[at:], and
    where its tensors end."""
    values = {}
    for holder_field in fields(holder):
        value = getattr(holder, holder_field.name)
        if is_dataclass(value):
            value, at = _with_tensors(value, tensors, at)
        elif isinstance(value, list):
            value, at = list(tensors[at:at + len(value)]), at + len(value)
        elif value is not None:
            value, at = tensors[at], at + 1
        values[holder_field.name] = value
    return type(holder)(**values), at


def move_slot(state: DecodeState, source: int, target: int) -> None:
    """Copies every per-slot row from `source` to `target` (the engine keeps active slots contiguous)."""
    for tensor in state.tensors():
        tensor[target] = tensor[source]
