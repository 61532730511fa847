"""What a user asks of one request, and what they get back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS
from .errors import CompiledSpecError, shown

# Per-request caps. The engine keeps counts in int64 state; stop strings are matched against the text after every
# step, in the engine thread and in the server's event loop, so their number and length are bounded.
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_CHOICES = 256  # n; each choice takes a slot, and an engine has at most 256
MAX_STOP_CHARACTERS = 256
# A sampled row divides its logits by the temperature; below this it overflows float32, so it decodes greedily.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0  # far past uniform already; float32 state holds no more than 3.4e38


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    # Drafts a step may verify for this request: 0..the engine's K, or None / "auto": as many as the engine's step
    # drafts (its k, or with -k auto the k it chooses). Lossless either way: it changes speed, never the distribution.
    num_speculative_tokens: int | str | None = None
    # Log-probabilities of each emitted token under the target's raw distribution (log_softmax of the logits, before
    # temperature, top-k and top-p), with this many of the most likely tokens beside it; None: none. 0..the engine's
    # max_logprobs (LLM(max_logprobs=...), serve --max-logprobs).
    logprobs: int | None = None
    # Independent choices of one prompt: they share its prefill and decode in n slots. With a seed, choice i samples
    # with seed + i, so it equals a request of its own with that seed.
    n: int = 1
    # JSON output: a JSON schema (a dict) the output must satisfy, or True for any JSON object (OpenAI's json_object).
    # Every emitted token, drafts included, comes from the target masked by the schema's grammar, so the output is what
    # masked plain decoding gives at any k. Needs LLM(structured_output=True); the server has it on.
    json_schema: dict | bool | None = None

    def __post_init__(self):
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or not 0 <= self.temperature <= MAX_TEMPERATURE):
            raise CompiledSpecError(f"temperature={self.temperature!r} is invalid; allowed: a number in "
                                    f"0..{MAX_TEMPERATURE:g} (0 = greedy; below {MIN_SAMPLING_TEMPERATURE:g} decodes "
                                    f"greedily)", param="temperature")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise CompiledSpecError(f"top_p={self.top_p!r} is out of range; allowed (0, 1]", param="top_p")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOKENS_LIMIT:
            raise CompiledSpecError(f"top_k={self.top_k!r} is invalid; allowed: 0 (off) or an integer in "
                                    f"1..{MAX_TOKENS_LIMIT}", param="top_k")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise CompiledSpecError(f"max_tokens={self.max_tokens!r} is invalid; allowed: a positive integer up to "
                                    f"{MAX_TOKENS_LIMIT}", param="max_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise CompiledSpecError(f"seed={self.seed!r} is out of range; allowed 0..2**63-1", param="seed")
        k = self.num_speculative_tokens
        if k is not None and k != "auto" and (isinstance(k, bool) or not isinstance(k, int)
                                              or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise CompiledSpecError(f"num_speculative_tokens={k!r} is invalid; allowed: an integer in "
                                    f"0..{MAX_SPECULATIVE_TOKENS} or 'auto'", param="num_speculative_tokens")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise CompiledSpecError(f"logprobs={self.logprobs!r} is invalid; allowed: an integer in 0..{MAX_LOGPROBS} "
                                    "(the most likely tokens shown beside each emitted one) or None", param="logprobs")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise CompiledSpecError(f"n={self.n!r} is invalid; allowed: an integer in 1..{MAX_CHOICES} (and at most "
                                    "the engine's max_batch_size)", param="n")
        if self.json_schema is not None and self.json_schema is not True and not isinstance(self.json_schema, dict):
            raise CompiledSpecError(f"json_schema={shown(self.json_schema)} is invalid; allowed: a JSON schema (a "
                                    "dict), True (any JSON object) or None", param="json_schema")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)) and len(self.stop) > MAX_STOP_STRINGS:
            raise CompiledSpecError(f"stop has {len(self.stop)} strings; allowed: at most {MAX_STOP_STRINGS}",
                                    param="stop")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise CompiledSpecError(f"stop={self.stop!r} is invalid; allowed: a list of non-empty strings", param="stop")
        if self.stop is not None and max(map(len, self.stop), default=0) > MAX_STOP_CHARACTERS:
            longest = max(map(len, self.stop))
            raise CompiledSpecError(f"stop has a string of {longest} characters; allowed: at most "
                                    f"{MAX_STOP_CHARACTERS} characters each", param="stop")


@dataclass
class SpecStats:
    """Speculation statistics of one request: per verify step, some drafts verified, a prefix accepted.

    num_speculative_tokens is the most drafts a step verifies (K); with k = auto a step may verify fewer, and
    steps_per_num_drafts counts the steps by the k chosen for them. tree_steps counts those that verified the
    token tree (under its depth in steps_per_num_drafts too), leaf_steps those whose accepted path ended on one of
    its leaves (where the chain's draft was rejected)."""

    num_speculative_tokens: int
    steps: int = 0
    drafted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    steps_per_num_drafts: dict[int, int] = field(default_factory=dict)
    tree_steps: int = 0
    leaf_steps: int = 0

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens
        if not self.verified_per_position:
            self.verified_per_position = [0] * self.num_speculative_tokens

    def record(self, accepted: int, verified: int | None = None, num_drafts: int | None = None,
               tree: bool = False, on_leaf: bool = False) -> None:
        """One step that verified `verified` drafts (default K) and accepted the first `accepted`; num_drafts: the
        k the step ran with (default: verified); tree: it verified the token tree; on_leaf: its path ended on a
        leaf."""
        verified = self.num_speculative_tokens if verified is None else verified
        num_drafts = verified if num_drafts is None else num_drafts
        self.steps += 1
        self.tree_steps += tree
        self.leaf_steps += on_leaf
        self.drafted += verified
        self.steps_per_num_drafts[num_drafts] = self.steps_per_num_drafts.get(num_drafts, 0) + 1
        for position in range(verified):
            self.verified_per_position[position] += 1
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Per draft position: accepted / verified (with a fixed k, every step verifies every position)."""
        return [count / verified if verified else 0.0
                for count, verified in zip(self.accepted_per_position, self.verified_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts plus the one sampled by the target."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def merge(self, other: "SpecStats") -> None:
        self.steps += other.steps
        self.tree_steps += other.tree_steps
        self.leaf_steps += other.leaf_steps
        self.drafted += other.drafted
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count
        for position, count in enumerate(other.verified_per_position):
            self.verified_per_position[position] += count
        for k, count in other.steps_per_num_drafts.items():
            self.steps_per_num_drafts[k] = self.steps_per_num_drafts.get(k, 0) + count


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target's raw distribution, and the most likely tokens there
    (best first, as many as the request's logprobs asked)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", or "error"
    error: str | None = None
    stats: SpecStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for logprobs
    index: int = 0  # which of the request's n choices this is
    # With n > 1 the output LLM.generate returns for the prompt is choice 0's, and this lists all n (it first).
    choices: list["RequestOutput"] | None = None
