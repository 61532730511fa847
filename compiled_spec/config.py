"""Model configuration (read from a Hugging Face config.json) and engine options, with validation."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import CompiledSpecError

if TYPE_CHECKING:
    from .hisparse.config import HiSparseConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Glm4MoeForCausalLM")
# Configs saved without a model class name only carry model_type.
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


GRAPH_MODE_VARIABLE = "COMPILED_SPEC_GRAPH_MODE"
# The fastest graph mode a GPU run has shown equal to eager in tokens and per-step accepted counts (an H200, torch
# 2.11: compile equal on every prompt; piecewise diverged at the first step; full's replay never finished). Raise it
# when python -m compiled_spec.benchmarks.cuda_check shows a faster mode equal.
CUDA_DEFAULT = "compile"


class GraphMode(str, enum.Enum):
    EAGER = "eager"
    COMPILE = "compile"
    PIECEWISE = "piecewise"
    FULL = "full"

    @classmethod
    def default_for(cls, device: str) -> "GraphMode":
        """full on CPU; on CUDA the fastest mode a GPU run has shown equal to eager in tokens and accepted counts
        (CUDA_DEFAULT; python -m compiled_spec.benchmarks.cuda_check shows it). The environment variable COMPILED_SPEC_GRAPH_MODE
        names another default. (On CPU the LLM starts tiered: it decodes in eager while full's packages compile in
        the background.)"""
        fallback = cls(CUDA_DEFAULT) if device.startswith("cuda") else cls.FULL
        return cls.parse(os.environ.get(GRAPH_MODE_VARIABLE, fallback.value), source=GRAPH_MODE_VARIABLE)

    @classmethod
    def parse(cls, value: "str | GraphMode", source: str | None = None) -> "GraphMode":
        """source: where the value came from (an environment variable), named in the error."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            what = f"{source}={value!r} is not a graph mode" if source else f"unknown graph mode {value!r}"
            raise CompiledSpecError(f"{what}; choose one of: {allowed}") from None


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    num_mtp_modules: int
    # MoE (Glm4Moe); zero experts means every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    num_expert_groups: int = 1
    topk_groups: int = 1
    scoring_func: str = "sigmoid"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_is_moe(self, layer_index: int) -> bool:
        return self.num_experts > 0 and layer_index >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type", "?")
        architectures = raw.get("architectures") or [ARCHITECTURE_OF_MODEL_TYPE.get(model_type, model_type)]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise CompiledSpecError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            rope = dict(raw.get("rope_parameters") or {})
            legacy_scaling = raw.get("rope_scaling") or {}
            rope = {**legacy_scaling, **rope}
            rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            partial = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            rope["rope_type"] = rope_type
            attention_bias = bool(raw.get("attention_bias", False))
            qkv_bias, o_bias = {
                "LlamaForCausalLM": (attention_bias, attention_bias),
                "Qwen2ForCausalLM": (True, False),
                "Qwen3ForCausalLM": (attention_bias, attention_bias),
                "Glm4MoeForCausalLM": (attention_bias, False),
            }[architecture]
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            # The declared count; the checkpoint loader keeps only the modules whose weights exist.
            num_mtp = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0
            config = cls(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope,
                partial_rotary_factor=partial,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                qk_norm=architecture == "Qwen3ForCausalLM" or bool(raw.get("use_qk_norm", False)),
                num_mtp_modules=int(num_mtp),
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
            )
            if architecture == "Glm4MoeForCausalLM":
                config.num_experts = int(raw.get("n_routed_experts", 0))
                config.num_experts_per_tok = int(raw.get("num_experts_per_tok", 0))
                config.moe_intermediate_size = int(raw.get("moe_intermediate_size", 0))
                config.num_shared_experts = int(raw.get("n_shared_experts", 0))
                config.first_k_dense_replace = int(raw.get("first_k_dense_replace", 0))
                config.routed_scaling_factor = float(raw.get("routed_scaling_factor", 1.0))
                config.norm_topk_prob = bool(raw.get("norm_topk_prob", True))
                config.num_expert_groups = int(raw.get("n_group", 1) or 1)
                config.topk_groups = int(raw.get("topk_group", 1) or 1)
                config.scoring_func = raw.get("scoring_func", "sigmoid")
        except (KeyError, TypeError, ValueError) as error:
            raise CompiledSpecError(f"config.json is missing or has a bad value for {error}") from None
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise CompiledSpecError(
                f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3, yarn"
            )
        return config


MAX_SPECULATIVE_TOKENS = 8
# k when none is asked for, with MTP modules (a named model with its shipped modules has its own) or n-gram drafts.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
# The largest k auto may choose unless told otherwise.
DEFAULT_MAX_SPECULATIVE_TOKENS = 3
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_SEQ_LEN = 512
AUTO = "auto"
DRAFTERS = ("mtp", "ngram")  # speculative/ngram.py; docs/drafters.md
DTYPES = ("float32", "bfloat16", "float16")
# The most likely tokens a step can return beside each emitted token (OpenAI's top_logprobs allows up to 20).
MAX_LOGPROBS = 20
SERVE_MAX_LOGPROBS = 20  # serve's default: every request may ask (docs/serving.md, "Logprobs", for what it costs)


def dtype_name(dtype, checkpoint_dtype: str | None) -> str:
    """The engine dtype's name for `dtype`: a name, a torch.dtype, or "auto" (the checkpoint's own dtype,
    float32 when it names none or one the engine does not compute in)."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise CompiledSpecError(f"dtype={dtype} is not supported; choose float32, bfloat16 or float16 "
                                    "(as names or torch dtypes), or auto")
        return name
    if dtype == "auto":
        return checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
    return dtype


def draft_dtype_name(draft_dtype, engine_dtype: str) -> str:
    """The name of the dtype the drafts' weights are stored in: float16, or the engine's own (None)."""
    import torch

    name = str(draft_dtype).removeprefix("torch.") if isinstance(draft_dtype, torch.dtype) else draft_dtype
    if name is None:
        return engine_dtype
    if name not in ("float16", engine_dtype):
        raise CompiledSpecError(f"draft_dtype={draft_dtype!r} is not supported with dtype={engine_dtype!r}; choose "
                                f"'float16' or {engine_dtype!r} (the engine's)", param="draft_dtype")
    return name


MAX_TREE_WIDTH = 4


def parse_tree(spec) -> tuple[int, ...]:
    """A token tree (speculative/tree.py), one width per draft depth: '2,2,1' or (2, 2, 1) -> (2, 2, 1); raises
    ValueError naming the bad value and the allowed range."""
    if isinstance(spec, str):
        parts = [part.strip() for part in spec.split(",")]
        try:
            widths = tuple(int(part) for part in parts)
        except ValueError:
            raise ValueError(f"draft_tree={spec!r} is not a comma-separated list of widths, like '2,2,1'") from None
    else:
        widths = tuple(spec)
    if not widths:
        raise ValueError("draft_tree is empty; give one width per draft depth, like '2,2,1'")
    for width in widths:
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_TREE_WIDTH:
            raise ValueError(f"draft_tree={spec!r}: width {width!r} is out of range; allowed 1..{MAX_TREE_WIDTH}")
    return widths


def describe_tree(widths: tuple[int, ...]) -> str:
    return ",".join(str(width) for width in widths)


def tree_leaves(widths: tuple[int, ...] | None) -> int:
    """A tree's candidates besides the chain: the extra rows its verify pass has (0 for a chain, None)."""
    return sum(width - 1 for width in widths) if widths else 0


@dataclass(slots=True)
class EngineConfig:
    num_speculative_tokens: int | str = DEFAULT_NUM_SPECULATIVE_TOKENS  # or "auto": chosen per step, 0..max
    max_speculative_tokens: int = DEFAULT_MAX_SPECULATIVE_TOKENS
    graph_mode: GraphMode | None = None  # None: GraphMode.default_for(device), set by validate
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    batch_buckets: tuple[int, ...] | None = None
    prefill_buckets: tuple[int, ...] | None = None
    hisparse: "HiSparseConfig | None" = None
    verify_graphs_every: int = 0  # the graph canary checks every N-th step against eager; 0: off
    draft_tree: tuple[int, ...] | None = None  # widths per depth (speculative/tree.py); the k=len step verifies it
    drafter: str | None = None  # "mtp" or "ngram"; None: set by resolve_drafter, MTP where the model has modules
    # Steps return each emitted token's log-probability and the max_logprobs most likely tokens (0: off, no cost).
    max_logprobs: int = 0
    # Requests may ask for JSON output (SamplingParams.json_schema): steps then mask every verify row's logits with the
    # request's grammar (speculative/token_masks.py; False: no masks, no cost).
    structured_output: bool = False

    def torch_dtype(self):
        import torch

        if self.dtype not in DTYPES:
            raise CompiledSpecError(f"dtype={self.dtype!r} is not supported; choose float32, bfloat16 or float16")
        return getattr(torch, self.dtype)

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def max_drafts(self) -> int:
        """K: the most drafts one step makes (max_speculative_tokens with auto)."""
        return self.max_speculative_tokens if self.auto else self.num_speculative_tokens

    @property
    def tree_width(self) -> int:
        """The widest depth of the draft tree: how many candidates a depth's draft slots hold (1: chains)."""
        return max(self.draft_tree) if self.draft_tree else 1

    def _parse_tree(self) -> None:
        """Parses draft_tree; a k left unset (None) becomes the tree's depth."""
        try:
            self.draft_tree = parse_tree(self.draft_tree)
        except ValueError as error:
            raise CompiledSpecError(str(error), param="draft_tree") from None
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = len(self.draft_tree)

    def _validate_tree(self) -> None:
        depth, spec = len(self.draft_tree), describe_tree(self.draft_tree)
        if self.auto and depth > self.max_speculative_tokens:
            raise CompiledSpecError(f"draft_tree={spec!r} is {depth} deep; with num_speculative_tokens='auto' it may "
                                    f"be at most max_speculative_tokens={self.max_speculative_tokens} deep",
                                    param="draft_tree")
        if not self.auto and self.num_speculative_tokens != depth:
            raise CompiledSpecError(f"draft_tree={spec!r} is {depth} deep but num_speculative_tokens="
                                    f"{self.num_speculative_tokens!r}; leave k out or give k={depth} or 'auto'",
                                    param="draft_tree")

    def resolve_drafter(self, model_config: ModelConfig) -> str:
        """The drafter asked for, checked, or by default "mtp" for a model with MTP modules and else "ngram"."""
        if self.drafter is None:
            self.drafter = "mtp" if model_config.num_mtp_modules else "ngram"
        if self.drafter not in DRAFTERS:
            raise CompiledSpecError(f"drafter={self.drafter!r} is not a drafter; choose one of {', '.join(DRAFTERS)}",
                                    param="drafter")
        return self.drafter

    def validate(self, model_config: ModelConfig) -> None:
        self.resolve_drafter(model_config)
        if self.draft_tree is not None:
            self._parse_tree()
        every = self.verify_graphs_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise CompiledSpecError(f"verify_graphs_every={every!r} must be 0 (off) or a number of steps")
        logprobs = self.max_logprobs
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise CompiledSpecError(f"max_logprobs={logprobs!r} is out of range; allowed 0 (off)..{MAX_LOGPROBS}",
                                    param="max_logprobs")
        k = self.num_speculative_tokens
        if self.auto:
            limit = self.max_speculative_tokens
            if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SPECULATIVE_TOKENS:
                raise CompiledSpecError(
                    f"max_speculative_tokens={limit!r} is out of range; allowed 1..{MAX_SPECULATIVE_TOKENS}"
                )
            k = limit
        elif isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise CompiledSpecError(
                f"num_speculative_tokens={k!r} is out of range; allowed 0..{MAX_SPECULATIVE_TOKENS}, or 'auto'"
            )
        if k > 0 and self.drafter == "mtp" and model_config.num_mtp_modules == 0:
            raise CompiledSpecError(
                f"num_speculative_tokens={self.num_speculative_tokens} with drafter='mtp' needs MTP weights, but this "
                "checkpoint has no MTP modules; use drafter='ngram' or num_speculative_tokens=0", param="drafter"
            )
        if not isinstance(self.structured_output, bool):
            raise CompiledSpecError(f"structured_output={self.structured_output!r} must be True or False",
                                    param="structured_output")
        if self.structured_output and self.draft_tree is not None:
            raise CompiledSpecError(f"structured_output=True masks a chain's verify rows; it does not take "
                                    f"draft_tree={describe_tree(self.draft_tree)!r} (leave the tree out)",
                                    param="structured_output")
        if self.drafter == "ngram" and self.draft_tree is not None:
            raise CompiledSpecError(f"draft_tree={describe_tree(self.draft_tree)!r} needs drafter='mtp': n-gram "
                                    "drafts are one chain", param="draft_tree")
        self.graph_mode = (GraphMode.default_for(self.device) if self.graph_mode is None
                           else GraphMode.parse(self.graph_mode))
        if not isinstance(self.max_batch_size, int) or not 1 <= self.max_batch_size <= 256:
            raise CompiledSpecError(f"max_batch_size={self.max_batch_size!r} is out of range; allowed 1..256")
        limit = model_config.max_position_embeddings
        if not isinstance(self.max_seq_len, int) or not 2 <= self.max_seq_len <= limit:
            raise CompiledSpecError(
                f"max_seq_len={self.max_seq_len!r} is out of range; allowed 2..{limit} "
                "(the model's max_position_embeddings)"
            )
        self.torch_dtype()
        if self.draft_tree is not None:
            self._validate_tree()
        if self.hisparse is not None:
            from .hisparse.config import HiSparseConfig

            if not isinstance(self.hisparse, HiSparseConfig):
                raise CompiledSpecError(f"hisparse={self.hisparse!r} must be None or a HiSparseConfig")
            self.hisparse.validate(self.max_drafts, tree_leaves=tree_leaves(self.draft_tree))
