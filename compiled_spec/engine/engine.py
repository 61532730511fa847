"""The scheduler: slot-based continuous batching over the persistent decode state, for LLM.generate and the server.

Requests wait in a queue until a slot is free. Active requests occupy slots 0..n-1. Between steps the engine admits
requests into free slots (prefill) and frees finished ones by moving the last active slot into the hole, so the step
always runs on a prefix of the slots, padded up to a batch bucket (full on CPU, with one step package for every
batch, runs n requests on n lanes: StepRunner.batch_for); padding lanes are free slots marked done.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Callable

import torch

from ..compiler.step_runner import StepRunner
from ..config import EngineConfig, GraphMode
from ..detokenizer import IncrementalDetokenizer
from ..model.causal_lm import CausalLM
from ..params import MIN_SAMPLING_TEMPERATURE, TokenLogprob
from ..speculative.state import move_slot
from ..speculative.step import Drafts
from ..speculative.token_masks import ALL_TOKENS
from .buckets import pick_bucket
from .canary import SAFER_MODE, GraphCanary
from .decode_setup import allocate_state, batch_buckets, prefill_buckets, step_constants
from .draft_chooser import DraftLengthChooser, LaneOutcome
from .draft_timing import FixedDrafts, calibration_request
from .request import Request, StepRecord, TokenCallback
from .structured_output import Grammars
from .startup import GraphStartup, StartOptions

__all__ = ["Engine", "Request", "StartOptions", "StepRecord", "TokenCallback"]


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_ids: tuple[int, ...], tokenizer=None,
                 start: StartOptions | None = None):
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.max_drafts = config.max_drafts  # K: draft slots in the state; a step drafts k <= K of them
        self.chooser = DraftLengthChooser(self.max_drafts, draft_tree=config.draft_tree) if config.auto else None
        self.state = allocate_state(model, config)
        self.constants = step_constants(model, config, self.state, eos_ids)
        self.eos_ids = set(eos_ids)
        self.batch_buckets = batch_buckets(config)
        self.prefill_buckets = prefill_buckets(config)
        self.runner = StepRunner(model, self.state, self.constants, config.graph_mode,
                                 step_drafts=tuple(self.step_drafts()),
                                 prefill_width=self.prefill_buckets[-1], batch_size=self.batch_buckets[-1])
        self.startup = GraphStartup(self, start or StartOptions())
        self.waiting: deque[Request] = deque()
        self.slots: list[Request] = []
        self.step_log: list[list[tuple[int, int]]] = []  # per step of run(): (request index, accepted) of each lane
        self.step_seconds: list[float] = []  # wall time of each step of run(), the host copy of its results included
        self.steps_run = 0
        self.last_num_drafts: int | None = None  # k of the last step
        self.eager_prefills = 0  # prompts longer than every prefill bucket (or of n choices), prefilled in eager
        self.prefills = 0  # main-model passes over a prompt: one per request, whatever its n
        self.canary = GraphCanary(config.verify_graphs_every) if config.verify_graphs_every else None
        self.switches: list[int] = []  # steps_run at each use_runner after the first runner
        self.fallbacks: list[GraphMode] = []  # the mode of each fall_back
        self._grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler of structured output, made at the first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, tuple(sorted(self.eos_ids)))
        return self._grammars

    def use_runner(self, runner: StepRunner, initial: bool = False) -> None:
        """Between two steps: the next steps run on `runner`, which must be bound to this engine's state. Unless it
        is the runner the engine starts with (initial), that is a switch: the chooser's step times were the old
        runner's, so each (bucket, drafts) is timed again on its first step."""
        if runner.state is not self.state:
            raise ValueError("the runner must be bound to this engine's state")
        self.runner = runner
        if not initial:
            self.switches.append(self.steps_run)
            if self.chooser:
                self.chooser.seconds.clear()

    def fall_back(self) -> None:
        """Between two steps: the next steps run in the next safer graph mode (full, piecewise -> compile -> eager),
        compiled on its first call. A full graph still compiling in the background is dropped."""
        mode = SAFER_MODE.get(self.runner.mode, GraphMode.EAGER)
        self.startup.stop_background()
        self.constants = self.constants._replace(opaque_attention=mode == GraphMode.PIECEWISE)
        self.use_runner(StepRunner(self.model, self.state, self.constants, mode, step_drafts=self.runner.step_drafts,
                                   prefill_width=self.prefill_buckets[-1], batch_size=self.batch_buckets[-1]))
        self.fallbacks.append(mode)

    @contextmanager
    def drafting(self, chooser):
        """Steps inside choose their drafts with `chooser` (calibration's and the benchmark's FixedDrafts)."""
        own = self.chooser
        self.chooser = chooser
        try:
            yield chooser
        finally:
            self.chooser = own

    def calibrate(self, prompt_ids: list[int], max_tokens: int = 48) -> None:
        """k = auto: decodes one greedy request with the longest chain (K drafts) and, with a token tree, one with the
        tree, and seeds the chooser's acceptance estimates from the steps of both."""
        chooser, steps = self.chooser, []
        runs = [Drafts(chooser.max_drafts)] if chooser.max_drafts else []
        for drafts in runs + [candidate for candidate in chooser.candidates if candidate.tree]:
            request = calibration_request(prompt_ids, max_tokens, self.max_drafts)
            with self.drafting(FixedDrafts(drafts)) as fixed:
                self.last_num_drafts = drafts.k  # admits with k, steps with drafts
                self.admit(request)
                while self.slots:
                    self.step()
            steps += fixed.observed
        chooser.seed_acceptance(steps)

    def step_drafts(self) -> list[Drafts]:
        """What steps verify and draft: with auto every chain 0..K and the token tree, else the tree or the K chain."""
        if self.chooser:
            return list(self.chooser.candidates)
        return [Drafts(self.max_drafts, tree=self.config.draft_tree is not None)]

    def run(self, requests: list[Request], on_tokens: TokenCallback | None = None) -> None:
        """Decodes a known list of requests to the end, recording every step in step_log and step_seconds."""
        self.waiting.extend(requests)
        while self.has_work():
            self.admit_waiting(on_tokens)
            if self.slots:
                record = self.step(on_tokens)
                self.step_log.append(record.lanes)
                self.step_seconds.append(record.seconds)

    def add(self, request: Request) -> None:
        """Queues a request; admit_waiting admits it once a slot is free."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.slots)

    def has_free_slot(self, needed: int = 1) -> bool:
        return len(self.slots) + needed <= self.config.max_batch_size

    def admit_waiting(self, on_tokens: TokenCallback | None = None,
                      on_error: Callable[[Request, Exception], None] | None = None,
                      on_admitting: Callable[[Request], None] | None = None) -> list[Request]:
        """Admits waiting requests, oldest first, while slots are free (between steps; a request of n choices waits for
        n); returns those their first token finished. A request whose admission raises goes to on_error (without one,
        the error propagates)."""
        finished = []
        while self.waiting and self.has_free_slot(len(self.waiting[0].choices)):
            request = self.waiting.popleft()
            if on_admitting is not None:
                on_admitting(request)
            try:
                finished += self.admit(request, on_tokens)
            except Exception as error:
                if on_error is None:
                    raise
                on_error(request, error)
        return finished

    def admit(self, request: Request, on_tokens: TokenCallback | None = None) -> list[Request]:
        """Prefills `request` into the next free slot, and its other choices (n > 1) into the slots after it, with one
        pass of the main model (between steps); returns those their first token finished."""
        choices = request.choices
        if not self.has_free_slot(len(choices)):
            raise RuntimeError("admit() needs a free slot for each choice; check has_free_slot() first")
        slot = len(self.slots)
        params = request.params
        state = self.state
        sampled = params.temperature >= MIN_SAMPLING_TEMPERATURE  # a tinier one would overflow the logits
        for lane, choice in enumerate(choices, start=slot):
            state.temperature[lane] = float(params.temperature) if sampled else 0.0
            state.top_k[lane] = params.top_k
            state.top_p[lane] = float(params.top_p)
            state.seeds[lane] = choice.seed
            state.ignore_eos[lane] = params.ignore_eos
            state.max_new_tokens[lane] = params.max_tokens
            state.draft_limits[lane] = self.draft_limit(params)
            state.generated[lane] = 0
            state.done[lane] = False
        if state.token_masks is not None:
            for lane, choice in enumerate(choices, start=slot):
                if request.grammar is not None:
                    choice.constraint = self.grammars.matcher(request.grammar)
                    choice.constraint.walk(state.token_masks[lane], [], 0)
                else:
                    state.token_masks[lane].fill_(ALL_TOKENS)
        length = len(request.prompt_ids)
        bucketed = length <= self.prefill_buckets[-1]
        widths = self.runner.prefill_widths
        if bucketed:
            width = max(length, widths[0]) if widths else pick_bucket(self.prefill_buckets, length)
        else:
            width = length
        device = state.seq_lens.device
        prompt = torch.zeros(1, width, dtype=torch.int64, device=device)
        prompt[0, :length] = torch.tensor(request.prompt_ids, dtype=torch.int64)
        # n choices prefill in eager: the compiled prefills fill one slot.
        prefill = self.runner.prefill if bucketed and len(choices) == 1 else self.runner.prefill_eager
        drafts = self._prefill_drafts()
        slots = torch.arange(slot, slot + len(choices), device=device)
        prefill(slots, prompt, torch.tensor([length], device=device), drafts)
        self.eager_prefills += prefill == self.runner.prefill_eager
        self.prefills += 1
        for choice in choices:
            if params.stop and self.tokenizer is not None:
                choice.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
            self.slots.append(choice)
        finished, *_ = self._collect(slot + len(choices), on_tokens, first_slot=slot, record_stats=False)
        return finished

    def draft_limit(self, params) -> int:
        """The most drafts a step verifies for a request with these SamplingParams (its own k, else K)."""
        k = params.num_speculative_tokens
        return self.max_drafts if k is None or k == "auto" else min(k, self.max_drafts)

    def _prefill_drafts(self) -> int:
        """K, or with auto the k of its last step: drafts past the k the next step verifies would cost a prefill
        one draft depth over the prompt each (the depths past k then hold none of its rows)."""
        return self.last_num_drafts if self.chooser and self.last_num_drafts is not None else self.max_drafts

    def step(self, on_tokens: TokenCallback | None = None) -> StepRecord:
        """One speculative step over every admitted request; finished requests leave their slots."""
        self.startup.poll_background()
        start = time.perf_counter()
        bucket = pick_bucket(self.batch_buckets, len(self.slots))
        batch = self.runner.batch_for(bucket, len(self.slots))
        drafts = self.chooser.choose(bucket) if self.chooser else self.runner.step_drafts[0]
        self.last_num_drafts = drafts.k
        if self.state.token_masks is not None:
            self._write_token_masks(drafts.k)
        divergence = None
        checked = bool(self.canary and self.runner.mode != GraphMode.EAGER and self.canary.due(self.steps_run + 1))
        if checked:
            divergence = self.canary.checked_step(self, batch, drafts, self.steps_run + 1)
        else:
            self.runner.step(batch, drafts)
        finished, lanes, verified, on_leaf, lane_drafts = self._collect(len(self.slots), on_tokens, first_slot=0,
                                                                        record_stats=True, drafts=drafts)
        seconds = time.perf_counter() - start
        self.steps_run += 1
        if self.canary:
            self.canary.observe(self.steps_run, seconds, checked)
        if self.chooser:
            outcomes = [LaneOutcome(v, accepted, leaf) for v, (_, accepted), leaf in zip(verified, lanes, on_leaf)]
            self.chooser.observe_step(bucket, drafts, seconds, outcomes)
        return StepRecord(finished, lanes, seconds, drafts.k, verified, divergence, drafts.tree, on_leaf, lane_drafts)

    def _write_token_masks(self, k: int) -> None:
        """Each constrained lane's grammar masks for the verify rows of a step drafting k, and its drafts where the
        grammar forces them (structured_output.py): the tokens, a one-hot q for MTP drafts, the count."""
        lanes = [slot for slot, request in enumerate(self.slots) if request.constraint is not None]
        if not lanes:
            return
        s = self.state
        rows = torch.tensor(lanes)
        drafts = s.draft_tokens[rows, :k].tolist()
        counts = s.draft_counts[rows].tolist() if k else [0] * len(lanes)
        on_host = s.token_masks.device.type == "cpu"
        masks = s.token_masks if on_host else torch.empty(len(lanes), *s.token_masks.shape[1:], dtype=torch.int32)
        for offset, slot in enumerate(lanes):
            request = self.slots[slot]
            limit = min(k, self.draft_limit(request.params))
            verified = drafts[offset][: min(limit, counts[offset])]
            new, forced = request.constraint.walk(masks[slot if on_host else offset], verified, limit)
            for row in forced:
                s.draft_tokens[slot, row] = new[row]
                if s.draft_probs.shape[1]:  # MTP drafts keep their q; a forced one's is one-hot
                    s.draft_probs[slot, row] = 0.0
                    s.draft_probs[slot, row, new[row]] = 1.0
            if len(new) != len(verified):
                s.draft_counts[slot] = len(new)
        if not on_host:
            s.token_masks[rows.to(s.token_masks.device)] = masks.to(s.token_masks.device)

    def abort(self, index: int) -> Request | None:
        """Drops the waiting request with this index, or frees the slot of the running one (between steps); None if
        there is neither."""
        for request in self.waiting:
            if request.index == index:
                self.waiting.remove(request)
                request.output.finish_reason = "abort"
                return request
        for slot, request in enumerate(self.slots):
            if request.index == index:
                request.output.finish_reason = "abort"
                if self.tokenizer is not None:
                    request.output.text = self.tokenizer.decode(request.output.token_ids, skip_special_tokens=True)
                self._free(slot)
                return request
        return None

    def _collect(self, end: int, on_tokens, first_slot: int, record_stats: bool, drafts: Drafts = Drafts(0)):
        """Reads what slots first_slot..end-1 emitted (one device-to-host copy) and frees finished slots.

        drafts: what the step verified and drafted. Returns the finished requests, per lane (request index, accepted
        drafts), per lane the drafts it verified, per lane whether its path ended on a leaf of the token tree, and
        per lane the drafts it made.
        """
        s = self.state
        packed = torch.cat(
            [s.step_tokens[first_slot:end], s.step_emitted[first_slot:end, None], s.step_accepted[first_slot:end, None],
             s.step_verified[first_slot:end, None], s.step_on_leaf[first_slot:end, None].long(),
             s.done[first_slot:end, None].long()], dim=1
        ).tolist()
        logprobs = self._read_logprobs(first_slot, end, [row[: self.max_drafts + 1] for row in packed])
        finished, finished_slots, lanes, verified_counts, on_leaf, lane_drafts = [], [], [], [], [], []
        for offset, row in enumerate(packed):
            slot = first_slot + offset
            request = self.slots[slot]
            tokens, (count, accepted, verified, leaf, done) = row[: self.max_drafts + 1], row[self.max_drafts + 1:]
            if record_stats:
                lanes.append((request.index, accepted))
                verified_counts.append(verified)
                on_leaf.append(bool(leaf))
                lane_k = min(drafts.k, self.draft_limit(request.params))  # what this request's lane drafted
                lane_drafts.append(lane_k)
                if self.max_drafts > 0:
                    request.output.stats.record(accepted, verified, lane_k, tree=drafts.tree and lane_k > 0,
                                                on_leaf=bool(leaf))
            kept = len(request.output.token_ids)
            emitted = tokens[:count]
            complete = False
            if request.constraint is not None:
                emitted = emitted[: request.constraint.accept(emitted)]
                complete = request.constraint.complete
            stopped = self._append(request, emitted)
            new_tokens = request.output.token_ids[kept:]  # a stop string drops the tokens after it
            if request.output.logprobs is not None:
                request.output.logprobs += logprobs(offset, len(new_tokens), request.params.logprobs)
            if on_tokens is not None and new_tokens:
                on_tokens(request.index, new_tokens)
            if done or stopped or complete:
                self._finish(request, stopped, complete)
                finished.append(request)
                finished_slots.append(slot)
        for slot in reversed(finished_slots):
            self._free(slot)
        return finished, lanes, verified_counts, on_leaf, lane_drafts

    def _read_logprobs(self, first_slot: int, end: int, tokens: list[list[int]]):
        """What the last call wrote of the emitted `tokens`' log-probabilities (one more copy, made only when a request
        in first_slot..end-1 asked for them): a function (lane offset, tokens, top N) -> [TokenLogprob]."""
        s = self.state
        if s.step_logprobs is None or all(r.params.logprobs is None for r in self.slots[first_slot:end]):
            return lambda offset, count, top: []
        chosen, top_values, top_ids = (s.step_logprobs[first_slot:end].tolist(),
                                       s.step_top_logprobs[first_slot:end].tolist(),
                                       s.step_top_ids[first_slot:end].tolist())

        def lane(offset: int, count: int, top: int) -> list[TokenLogprob]:
            return [TokenLogprob(tokens[offset][j], chosen[offset][j],
                                 list(zip(top_ids[offset][j][:top], top_values[offset][j][:top])))
                    for j in range(count)]
        return lane

    def _append(self, request: Request, new_tokens: list[int]) -> bool:
        """Adds tokens; returns True when a stop string appeared (tokens after it are dropped)."""
        output = request.output
        detokenizer = request.detokenizer
        if detokenizer is None:
            output.token_ids.extend(new_tokens)
            return False
        for token in new_tokens:
            output.token_ids.append(token)
            if detokenizer.add(token):
                text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
                cuts = [text.find(stop) for stop in request.params.stop if stop in text]
                output.text = text[:min(cuts, default=detokenizer.stop_at)]
                return True
        return False

    def _finish(self, request: Request, stopped: bool, complete: bool = False) -> None:
        """stopped: at a stop string (the text is cut there already); complete: at the end of the request's grammar."""
        output = request.output
        if stopped:
            output.finish_reason = "stop"
            return
        eos_hit = bool(output.token_ids) and output.token_ids[-1] in self.eos_ids and not request.params.ignore_eos
        output.finish_reason = "stop" if eos_hit or complete else "length"
        if self.tokenizer is not None:
            output.text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)

    def _free(self, slot: int) -> None:
        last = len(self.slots) - 1
        if slot != last:
            move_slot(self.state, last, slot)
            self.slots[slot] = self.slots[last]
        self.slots.pop()
        self.state.done[last] = True
