"""The Python API: LLM.generate, LLM.chat, LLM.logits, LLM.mtp_logits."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch

from .chat import chat_prompt
from .compiler.background_compile import compile_worker_count
from .config import (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SPECULATIVE_TOKENS, EngineConfig,
                     GraphMode, draft_dtype_name, dtype_name)
from .engine.decode_setup import allocate_state, step_constants
from .engine.engine import Engine, Request, StartOptions, TokenCallback
from .engine.engine_spec import EngineSpec
from .errors import CompiledSpecError
from .hisparse.config import HiSparseConfig
from .loading.checkpoint import checkpoint_dtype
from .loading.registry import (default_draft_dtype, default_draft_vocab_size, default_num_speculative_tokens,
                               resolve_model, shipped_mtp_modules)
from .model.packed_linear import weight_format
from .params import RequestOutput, SamplingParams, SpecStats
from .speculative.step import make_layout

DEFAULT_MODEL = Path(__file__).parent / "default_model"


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        num_speculative_tokens: int | str | None = None,
        max_speculative_tokens: int = DEFAULT_MAX_SPECULATIVE_TOKENS,
        graph_mode: str | GraphMode | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        device: str = "cpu",
        dtype: "str | torch.dtype" = "float32",
        seed: int = 0,
        batch_buckets: tuple[int, ...] | None = None,
        prefill_buckets: tuple[int, ...] | None = None,
        warm_up: bool = True,
        show_progress: bool = True,
        hisparse: HiSparseConfig | None = None,
        mtp: str | Path | None = None,
        draft_vocab_size: int | None = None,
        draft_dtype: "str | torch.dtype | None" = None,
        background_compile: bool | None = None,
        compile_workers: int | None = None,
        verify_graphs_every: int = 0,
        dequantize: bool = False,
        quantize: str | None = None,
        draft_tree: "str | tuple[int, ...] | None" = None,
        drafter: str | None = None,
        max_logprobs: int = 0,
        structured_output: bool = False,
    ):
        """num_speculative_tokens: drafts per step (k), or "auto": before each step, the k in
        0..max_speculative_tokens with the most expected tokens per second, from step times measured at warm-up
        and the running acceptance. Default: 3 (with MTP modules or n-gram drafts; smollm2-135m with the
        modules shipped for it: 2, its fastest fixed k in the benchmark). mtp: a directory of MTP modules for the
        base model (compiled-spec train-mtp writes one); a named model uses the modules shipped for it.
        draft_vocab_size: drafts sample over the modules' most frequent tokens (default: a named model's own with
        the modules shipped for it, 8192 for smollm2-135m, else the size they were trained with; the vocabulary
        size, or more, drafts over all of it). draft_dtype: "float16" stores the MTP modules' matrices and the
        draft head in float16 and computes in dtype, so each draft streams half the bytes (lossless: only acceptance
        can move); the engine's dtype keeps them as they are (default: a named model's own on CPU with the modules
        shipped for it, float16 for smollm2-135m, else the engine's dtype). background_compile (tiered start; full
        on CPU): graphs with no saved package compile in a child process while the engine decodes in eager, and the
        engine switches to them between two steps when all are ready; default: on when graph_mode is left to its
        default, off when it is given.
        compile_workers (full on CPU): processes that compile missing packages at once, one graph each at a time;
        default: $COMPILED_SPEC_COMPILE_WORKERS, else one per CPU core (one graph's compile uses one core).
        verify_graphs_every: the graph canary (engine/canary.py): every N-th step also runs in eager on a copy of the
        decode state; a compiled step that wrote anything else is replaced by eager's result, and the engine falls
        back to a safer graph mode (full, piecewise -> compile -> eager). 0, the default: off.
        dequantize: a GGUF's quantized matrices are widened to dtype at load, instead of kept packed and multiplied
        by the weight-only quantized kernel (model/packed_linear.py).
        quantize: "q8_0" or "q4_0": a float checkpoint's (safetensors, or a GGUF of F32/F16/BF16 tensors) main-model
        matrices, embedding and head are quantized at load with the gguf package's quantizer and kept packed, as a
        GGUF file of that type would be; rows that are not whole 32-value blocks, and the MTP modules, stay float.
        draft_tree: a token tree, one width per draft depth ("2,2,1" or (2, 2, 1)): at each depth the main model
        verifies that many of the draft module's top candidates, the first continuing the chain and the others as
        leaves (speculative/tree.py). Its depth is k (default k: the tree's depth); with "auto", each step chooses the
        tree or a chain of 0..max_speculative_tokens drafts.
        drafter: what proposes the drafts. "mtp": the MTP modules; "ngram": the request's own tokens (prompt lookup,
        speculative/ngram.py), which needs no trained weights and pays where the output repeats the prompt or
        itself. Default: "mtp" for a model with MTP modules, else "ngram".
        max_logprobs: 1..20 lets requests ask for logprobs (SamplingParams.logprobs up to this many): each step then
        also returns every emitted token's log-probability under the target's raw distribution and the max_logprobs
        most likely tokens (speculative/logprobs.py). 0, the default: off, and steps compute none.
        structured_output: requests may ask for JSON (SamplingParams.json_schema): every step then masks its verify
        rows with each request's grammar (speculative/token_masks.py). Not with draft_tree. Default: off, no cost."""
        self.path = resolve_model(model) or DEFAULT_MODEL
        mtp = mtp if mtp is not None else shipped_mtp_modules(self.path)
        self.mtp_path = None if mtp is None else Path(mtp)
        self.config = EngineConfig(
            num_speculative_tokens=num_speculative_tokens,
            max_speculative_tokens=max_speculative_tokens,
            graph_mode=graph_mode,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            device=device,
            dtype=dtype_name(dtype, checkpoint_dtype(self.path) if dtype == "auto" else None),
            seed=seed,
            batch_buckets=batch_buckets,
            prefill_buckets=prefill_buckets,
            hisparse=hisparse,
            verify_graphs_every=verify_graphs_every,
            draft_tree=draft_tree,
            drafter=drafter,
            max_logprobs=max_logprobs,
            structured_output=structured_output,
        )
        if draft_vocab_size is None:
            draft_vocab_size = default_draft_vocab_size(self.path, self.mtp_path)
        if draft_dtype is None:
            draft_dtype = default_draft_dtype(self.path, self.mtp_path, device)
        self.spec = EngineSpec(self.path, self.mtp_path, draft_vocab_size, draft_dtype_name(draft_dtype, self.config.dtype),
                               dequantize, quantize, self.config)
        self.model = self.spec.load_weights()
        self.model_config = self.model.config
        if num_speculative_tokens is None and draft_tree is None:  # with a tree, validate makes k its depth
            self.config.num_speculative_tokens = default_num_speculative_tokens(
                self.path, self.mtp_path, self.model_config.num_mtp_modules,
                self.config.resolve_drafter(self.model_config))
        self.config.validate(self.model_config)
        self.spec.attach_indexers(self.model)
        self.tokenizer, self.eos_ids = self.spec.load_tokenizer(self.model)
        if background_compile is None:
            background_compile = graph_mode is None and self.config.graph_mode == GraphMode.FULL and device == "cpu"
        if background_compile and (self.config.graph_mode != GraphMode.FULL or device != "cpu"):
            raise CompiledSpecError(f"background_compile=True needs graph_mode='full' on CPU, not "
                                    f"{self.config.graph_mode.value!r} on {device!r}")
        compile_worker_count(compile_workers, 1)  # a bad count or $COMPILED_SPEC_COMPILE_WORKERS fails here, not later
        start = StartOptions(calibration_prompt=self._calibration_prompt(),
                             spec=self.spec if self.config.graph_mode == GraphMode.FULL and device == "cpu" else None,
                             tiered_start=bool(background_compile), compile_workers=compile_workers)
        self.engine = Engine(self.model, self.config, self.eos_ids, self.tokenizer, start)
        if warm_up:
            self.engine.startup.warm_up(show_progress)
        self._requests_made = itertools.count()  # seeds unseeded requests; next() is atomic across threads
        self._sibling_indices = itertools.count(-1, -1)  # the engine's indices of choices 1..n-1

    @property
    def weight_format(self) -> str:
        """How the main model's matrices are held: e.g. "Q4_1+Q8_0 packed", or "float32"."""
        return weight_format(self.model)

    @property
    def num_speculative_tokens(self) -> int | str:
        """k, or "auto"."""
        return self.config.num_speculative_tokens

    @property
    def draft_slots(self) -> int:
        """K, the most drafts one step verifies: k, or max_speculative_tokens with auto (the engine's max_drafts)."""
        return self.engine.max_drafts

    def _calibration_prompt(self) -> list[int] | None:
        """What k = auto decodes at warm-up to seed its acceptance estimates: a short text, as a chat turn for a
        model with a chat template."""
        if not self.config.auto:
            return None
        if self.tokenizer is None:
            return [self.model_config.bos_token_id or 0]
        text = "Write a short Python function that returns the sum of a list of numbers."
        if getattr(self.tokenizer, "chat_template", None):
            text = chat_prompt(self.tokenizer, [{"role": "user", "content": text}])
        return self.encode(text)[: self.config.max_seq_len // 2]

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise CompiledSpecError(f"{str(self.path)!r} has no tokenizer; pass prompts as lists of token ids",
                                        param="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in prompt):
            raise CompiledSpecError(f"token ids must be integers in 0..{self.model_config.vocab_size - 1}", param="prompt")
        return list(prompt)

    def _check_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str) and not prompt:
            raise CompiledSpecError("empty prompt; a prompt needs at least one token", param="prompt")
        ids = self.encode(prompt)
        if not ids:
            raise CompiledSpecError("empty prompt; a prompt needs at least one token", param="prompt")
        limit = self.config.max_seq_len - 1
        if len(ids) > limit:
            raise CompiledSpecError(
                f"prompt of {len(ids)} tokens is too long; max_seq_len={self.config.max_seq_len} "
                f"allows prompts of at most {limit} tokens", param="prompt"
            )
        return ids

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt. A bad prompt gets finish_reason "error" and does not stop the others.

        on_tokens(request_index, new_token_ids) is called as tokens are accepted (streaming).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise CompiledSpecError("empty prompt list; pass at least one prompt")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise CompiledSpecError(
                f"{len(params_list)} sampling params for {len(prompts)} prompts; pass one, or one per prompt"
            )
        outputs, requests = [], []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                request = self.make_request(index, prompt, params)
            except CompiledSpecError as error:
                outputs.append(RequestOutput([], finish_reason="error", error=str(error),
                                             stats=SpecStats(self.draft_slots)))
                continue
            outputs.append(request.output)
            requests.append(request)
        self.engine.run(requests, on_tokens)
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> list[RequestOutput]:
        """Answers one conversation ([{"role", "content"}, ...]) or a list of them through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([chat_prompt(self.tokenizer, c) for c in conversations], sampling_params, on_tokens)

    def make_request(self, index: int, prompt: str | list[int], params: SamplingParams) -> Request:
        """A checked request for the engine (a CompiledSpecError names what is wrong with the prompt). With n > 1 its
        other choices are its siblings, with negative indices of their own."""
        prompt_ids = self._check_prompt(prompt)
        k = params.num_speculative_tokens
        if isinstance(k, int) and k > self.draft_slots:
            raise CompiledSpecError(f"num_speculative_tokens={k} is out of range for this engine; allowed "
                                    f"0..{self.draft_slots} (its most drafts per step) or 'auto'",
                                    param="num_speculative_tokens")
        if params.logprobs is not None and (not self.config.max_logprobs or params.logprobs > self.config.max_logprobs):
            raise CompiledSpecError(
                f"logprobs={params.logprobs} is out of range for this engine; allowed 0..{self.config.max_logprobs}"
                if self.config.max_logprobs else
                "logprobs need an engine started with max_logprobs > 0 (LLM(max_logprobs=5), serve --max-logprobs 5)",
                param="logprobs")
        if params.n > self.config.max_batch_size:
            raise CompiledSpecError(f"n={params.n} is out of range for this engine; allowed "
                                    f"1..{self.config.max_batch_size} (its max_batch_size: each choice takes a slot)",
                                    param="n")
        if params.n > 1 and self.config.hisparse is not None:
            raise CompiledSpecError("n > 1 is not supported with HiSparse attention", param="n")
        grammar = self._grammar(params.json_schema)
        requests = []
        for choice in range(params.n):
            seed = (params.seed + choice) % 2**63 if params.seed is not None else \
                self.config.seed * 1_000_003 + next(self._requests_made)
            output = RequestOutput(prompt_token_ids=prompt_ids, stats=SpecStats(self.draft_slots),
                                   logprobs=None if params.logprobs is None else [], index=choice)
            requests.append(Request(index if choice == 0 else next(self._sibling_indices), prompt_ids, params, seed,
                                    output, grammar=grammar))
        if params.n > 1:
            requests[0].siblings = requests[1:]
            requests[0].output.choices = [request.output for request in requests]
        return requests[0]

    def _grammar(self, schema):
        if schema is None:
            return None
        if not self.config.structured_output:
            raise CompiledSpecError("json_schema needs an engine started with structured_output=True "
                                    "(LLM(structured_output=True); serve has it on)", param="json_schema")
        if self.tokenizer is None:
            raise CompiledSpecError("json_schema needs the model's tokenizer, and this checkpoint has none",
                                    param="json_schema")
        return self.engine.grammars.compile(schema)

    @torch.inference_mode()
    def _teacher_forced_hidden(self, token_ids: list[int]):
        ids = self._check_prompt(list(token_ids))
        device = self.config.device
        # One slot as long as the text, dense attention, eager, and a draft depth for mtp_logits.
        config = dataclasses.replace(self.config, num_speculative_tokens=max(1, self.draft_slots), max_batch_size=1,
                                     max_seq_len=len(ids) + 1, graph_mode=GraphMode.EAGER, hisparse=None,
                                     draft_tree=None, drafter="mtp")
        state = allocate_state(self.model, config)
        constants = step_constants(self.model, config, state, eos_ids=())
        tokens = torch.tensor([ids], device=device)
        positions = torch.arange(len(ids), device=device)[None]
        slot = torch.zeros(1, dtype=torch.int64, device=device)
        real = torch.ones_like(positions, dtype=torch.bool)
        layout = make_layout(state, constants, slot, positions, real, False)
        hidden = self.model.hidden_states(tokens, layout, state.main_keys, state.main_values)
        return ids, tokens, hidden, state, constants, slot

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Main-model logits [T, vocab] under teacher forcing: row i predicts token i+1."""
        _, _, hidden, *_ = self._teacher_forced_hidden(token_ids)
        return self.model.logits(hidden)[0]

    @torch.inference_mode()
    def mtp_logits(self, token_ids: list[int], depth: int = 1) -> torch.Tensor:
        """What MTP depth `depth` predicts under teacher forcing: [T - depth, vocab], row i predicts token i+depth+1."""
        num_modules = self.model_config.num_mtp_modules
        if num_modules == 0:
            raise CompiledSpecError("this checkpoint has no MTP modules")
        if not isinstance(depth, int) or not 1 <= depth <= num_modules:
            raise CompiledSpecError(f"depth={depth!r} is out of range; allowed 1..{num_modules}")
        ids, tokens, hidden, state, constants, slot = self._teacher_forced_hidden(token_ids)
        if len(ids) <= depth:
            raise CompiledSpecError(f"need more than {depth} tokens for MTP depth {depth}, got {len(ids)}")
        for current in range(1, depth + 1):
            rows = len(ids) - current
            positions = torch.arange(rows, device=tokens.device)[None]
            layout = make_layout(state, constants, slot, positions, torch.ones_like(positions, dtype=torch.bool), False)
            hidden = self.model.mtp_hidden_states(
                current, tokens[:, current:], hidden[:, :rows], layout, state.draft_keys[0], state.draft_values[0]
            )
        return self.model.logits(hidden)[0]
