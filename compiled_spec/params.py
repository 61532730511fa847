"""What a user asks of one request, and what they get back."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CompiledSpecError


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise CompiledSpecError(f"temperature={self.temperature!r} is invalid; allowed: >= 0 (0 = greedy)", param="temperature")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise CompiledSpecError(f"top_p={self.top_p!r} is out of range; allowed (0, 1]", param="top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise CompiledSpecError(f"top_k={self.top_k!r} is invalid; allowed: 0 (off) or a positive integer", param="top_k")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise CompiledSpecError(f"max_tokens={self.max_tokens!r} is invalid; allowed: a positive integer", param="max_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise CompiledSpecError(f"seed={self.seed!r} is out of range; allowed 0..2**63-1", param="seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise CompiledSpecError(f"stop={self.stop!r} is invalid; allowed: a list of non-empty strings", param="stop")


@dataclass
class SpecStats:
    """Speculation statistics of one request: per verify step, k drafted, a prefix accepted."""

    num_speculative_tokens: int
    steps: int = 0
    drafted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, accepted: int) -> None:
        self.steps += 1
        self.drafted += self.num_speculative_tokens
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [count / self.steps if self.steps else 0.0 for count in self.accepted_per_position]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts plus the one sampled by the target."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def merge(self, other: "SpecStats") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", or "error"
    error: str | None = None
    stats: SpecStats | None = None
