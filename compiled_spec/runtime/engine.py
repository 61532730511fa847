"""Slot-based continuous batching over the persistent decode state.

Active requests occupy slots 0..n-1. Between steps the runtime admits requests into free slots
(prefill) and frees finished ones by moving the last active slot into the hole, so the step always
runs on a prefix of the slots, padded up to a batch bucket (full on CPU, with one step package for every batch,
runs n requests on n lanes: StepRunner.batch_for); padding lanes are free slots marked done.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..config import EngineConfig, GraphMode
from ..hisparse.indexer import index_key_dims
from ..model.causal_lm import CausalLM
from ..model.rope import rotary_tables
from ..params import MIN_SAMPLING_TEMPERATURE, RequestOutput, SamplingParams, SpecStats
from ..speculative.state import DecodeState, move_slot
from ..speculative.step import StepConstants
from .background_compile import BackgroundCompile, compile_worker_count, earlier_failure, failed_file
from .canary import SAFER_MODE, Divergence, GraphCanary
from .buckets import (
    checked_buckets, compiled_prefill_limit, default_batch_buckets, default_prefill_buckets, pick_bucket,
)
from .draft_chooser import DraftLengthChooser
from .graph_modes import StepRunner
from .packaged import discard_package, package_damage

TokenCallback = Callable[[int, list[int]], None]
log = logging.getLogger(__name__)


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output: RequestOutput
    valid_drafts: int = 0  # drafts its slot holds for the next step (mirrors DecodeState.draft_counts)


@dataclass
class StepRecord:
    finished: list[Request]  # requests this step finished; their slots are free again
    lanes: list[tuple[int, int]]  # per lane: (request index, accepted drafts)
    seconds: float  # wall time, the host copy of the step's results included
    num_drafts: int = 0  # k: the drafts this step made for the next one
    verified: list[int] | None = None  # per lane: drafts it verified (fewer than k after a step with a smaller k)
    divergence: "Divergence | None" = None  # the canary checked this step and found the compiled one wrong


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_ids: tuple[int, ...], tokenizer=None):
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.k = config.draft_slots  # K: draft slots in the state; a step drafts k <= K of them
        self.chooser = DraftLengthChooser(self.k) if config.auto else None
        device = torch.device(config.device)
        dtype = config.torch_dtype()
        hisparse = config.hisparse
        self.state = DecodeState.allocate(
            model.config, config.max_batch_size, config.max_seq_len, self.k, dtype, device,
            **(dict(hot_rows=hisparse.hot_rows, index_dims=index_key_dims(model, self.k),
                   cold_dtype=hisparse.cold_torch_dtype(dtype), pinned_cold_pool=hisparse.cold_pool_pinned(device))
               if hisparse else {}),
        )
        cos, sin = rotary_tables(model.config, self.state.cache_capacity)
        self.constants = StepConstants(
            rope_cos=cos.to(device=device, dtype=dtype),
            rope_sin=sin.to(device=device, dtype=dtype),
            eos_ids=torch.tensor(eos_ids, dtype=torch.int64, device=device),
            max_seq_len=config.max_seq_len,
            opaque_attention=config.graph_mode == GraphMode.PIECEWISE,
            hisparse=hisparse,
        )
        self.eos_ids = set(eos_ids)
        self.batch_buckets = checked_buckets(
            config.batch_buckets or default_batch_buckets(config.max_batch_size), config.max_batch_size, "batch_buckets"
        )
        # A prompt longer than the largest prefill bucket prefills in eager at its own length (admit).
        compiled_limit = compiled_prefill_limit(device.type, config.graph_mode)
        self.prefill_buckets = checked_buckets(
            config.prefill_buckets or default_prefill_buckets(config.max_seq_len, compiled_limit), config.max_seq_len,
            "prefill_buckets", largest_below_limit=True,
        )
        self.runner = StepRunner(model, self.state, self.constants, config.graph_mode,
                                 draft_lengths=tuple(range(self.k)) if config.auto else (),
                                 prefill_width=self.prefill_buckets[-1], batch_size=self.batch_buckets[-1])
        self.slots: list[Request] = []
        self.step_log: list[list[tuple[int, int]]] = []  # per step: (request index, accepted) of each lane
        self.step_seconds: list[float] = []  # wall time of each decode step, the host copy of its results included
        self.warmup_seconds = 0.0
        self.calibration_prompt: list[int] | None = None  # what k = auto decodes at warm-up (the LLM sets it)
        self.llm_arguments: dict | None = None  # the LLM's (full on CPU): compile processes build this engine from them
        self.tiered_start = False  # warm-up decodes in eager while missing packages compile (needs llm_arguments)
        self.compile_workers: int | None = None  # processes that compile missing packages (None: one per core)
        self.compiled_in_processes: list[str] = []  # packages child processes compiled for warm-up (then loaded here)
        self.compile_processes = 1  # how many processes compiled them
        self.background: BackgroundCompile | None = None
        self.steps_run = 0
        self.last_num_drafts: int | None = None  # k of the last step
        self.eager_prefills = 0  # prompts longer than every prefill bucket, prefilled in eager at their own length
        self.switches: list[int] = []  # steps_run at each switch_runner
        self._full_runner, self._next_poll, self._show_progress, self._threads = None, 0.0, False, 1
        self.fallbacks: list[GraphMode] = []  # the mode of each fall back the canary made
        self.canary = GraphCanary(config.verify_graphs_every) if config.verify_graphs_every else None

    def draft_lengths(self) -> list[int | None]:
        """The k values steps run with: every 0..K with auto, else None (the fixed k)."""
        return list(range(self.k + 1)) if self.chooser else [None]

    def warm_up_graphs(self, runner: StepRunner | None = None) -> list[tuple[str, int, int | None]]:
        """(kind, size, k) of every graph warm-up makes for `runner` (default: this engine's): each batch bucket and,
        if the runner compiles prefill, each prefill bucket (or, full on CPU, one prefill package for every width up
        to the largest), for every k with auto (else k None: every draft slot).

        Full on CPU: the one step package for every batch (the longest compile, so it goes first), then the one
        prefill package; compile processes take them in this order."""
        runner = runner or self.runner
        ks = self.draft_lengths()
        sizes = [runner.step_batches[1]] if runner.step_batches else list(reversed(self.batch_buckets))
        graphs = [("step", size, k) for size in sizes for k in ks]
        if runner.prefill_widths:  # one package covers every width (full on CPU); the longest compiles go first
            prefills = [("prefill", runner.prefill_widths[1], k) for k in ks]
            return graphs + prefills if runner.step_batches else prefills + graphs
        if runner.compiles_prefill:
            graphs += [("prefill", size, k) for size in reversed(self.prefill_buckets) for k in ks]
        return graphs

    def warm_up(self, show_progress: bool = True) -> None:
        """Compiles every graph of warm_up_graphs() once, before any request is admitted. With auto it then times
        every (bucket, k) graph and seeds the acceptance estimates by decoding self.calibration_prompt.

        With llm_arguments set (full on CPU), packages that are missing compile in child processes, one graph per
        process at a time (compile_workers). With tiered_start the engine decodes in eager meanwhile and switches
        between two steps (poll_background); without, warm-up waits for them."""
        if self.config.graph_mode == GraphMode.EAGER and not self.chooser:
            return
        if self.slots:
            raise RuntimeError("warm_up() must run before requests are admitted")
        start = time.perf_counter()
        if self.config.graph_mode != GraphMode.EAGER:
            graphs = self.warm_up_graphs()
            paths = [self.runner.package_path(*graph) for graph in graphs]  # None where nothing is packaged
            damaged = {path: damage for path in paths if path is not None and path.exists()
                       and (damage := package_damage(path))}
            if damaged:
                log.warning("compiled-spec: compiled packages in %s are damaged (%s); compiling them again",
                            next(iter(damaged)).parent, "; ".join(f"{p.name}: {d}" for p, d in damaged.items()))
                for path in damaged:
                    discard_package(path)
            if self.tiered_start and not all(path and path.exists() for path in paths):
                if (failure := earlier_failure(paths)) is None:
                    self._start_in_eager(graphs, paths, show_progress)
                else:  # the same packages failed before: decode in eager, and say so once
                    self.runner = self._eager_runner()
                    log.warning("compiled-spec: the full graphs failed to compile in an earlier run (%s); decoding "
                                "in eager. Remove %s to try again", failure, failed_file(paths))
            else:
                self._compile_in_processes(graphs, paths, show_progress)
                self._compile_graphs(show_progress)
        if self.chooser:
            self._time_steps()
            if self.calibration_prompt:
                self._calibrate(self.calibration_prompt)
        self.warmup_seconds = time.perf_counter() - start

    def _compile_graphs(self, show_progress: bool) -> None:
        bar = tqdm(self.warm_up_graphs(), desc="compiling buckets", unit="graph", disable=not show_progress)
        for kind, size, k in bar:
            drafts = "" if k is None else f" k={k}"
            covered = self.runner.step_batches if kind == "step" else self.runner.prefill_widths
            sizes = f"{covered[0]}-{size}" if covered and size == covered[1] else str(size)  # one package, a range
            bar.set_postfix_str(f"{kind} {'batch' if kind == 'step' else 'prompt'}={sizes}{drafts}")
            self.compile_graph(kind, size, k)

    def _compile_in_processes(self, graphs: list, paths: list, show_progress: bool) -> None:
        """Compiles the missing packages in compile_workers child processes at once, where there are 2 or more of
        each (one graph's compile is single-threaded); _compile_graphs then loads them. If that fails, one warning,
        and _compile_graphs compiles them here (and raises the error, if it is not the children's own)."""
        if self.llm_arguments is None:
            return
        missing = [path for path in paths if path is not None and not path.exists()]
        workers = compile_worker_count(self.compile_workers, len(missing))  # at most one per missing graph
        if workers < 2:
            return
        children = BackgroundCompile(self.llm_arguments, graphs, paths, show_progress, workers=workers, niceness=0,
                                     description=f"compiling buckets in {workers} processes")
        status = children.wait()
        children.join()  # its processes still wind down after the last package: decoding beside them stalls
        self.compile_processes = workers
        self.compiled_in_processes = [path.name for path in missing if path.exists()]
        if status != "ready":
            log.warning("compiled-spec: compiling in %d processes failed (%s; log: %s); compiling here instead",
                        workers, children.failure(), children.log)
            children.stop()

    def compile_graph(self, kind: str, size: int, num_drafts: int | None) -> None:
        """Makes one graph of warm_up_graphs() by calling it once over free slots (every slot is free and marked
        done, so nothing live is touched)."""
        if self.slots:
            raise RuntimeError("compile_graph() needs every slot free")
        function, args = self.runner.warm_up_call(kind, size, num_drafts)
        with torch.inference_mode():
            function(*self.runner.bound, *args)
        self.state.done[0] = True  # a prefill over slot 0 marked it live

    def _start_in_eager(self, graphs: list, paths: list, show_progress: bool) -> None:
        """graphs (and their package paths): all of them (the child skips those whose package exists), so that every
        process that starts while some are still missing names the same compile and follows it."""
        self._full_runner = self.runner
        self.runner = self._eager_runner()
        missing = sum(not path.exists() for path in paths)
        self.background = BackgroundCompile(self.llm_arguments, graphs, paths, show_progress,
                                            workers=compile_worker_count(self.compile_workers, missing))
        self._show_progress = show_progress
        # Decode on one thread meanwhile: a kernel's threads wait at a barrier for the one the compile displaced
        # (on 2 cores eager made 3.7 tokens/s on two threads, 106.5 on one). The packages use the count they had.
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def _eager_runner(self) -> StepRunner:
        return StepRunner(self.model, self.state, self.constants, GraphMode.EAGER,
                          draft_lengths=self.runner.draft_lengths)

    def poll_background(self, wait: bool = False, timeout: float | None = None) -> str | None:
        """Between steps: switches to the full graphs once the background compile has made them all. Returns
        "ready" (switched now), "running", "failed" (the engine stays in eager; one warning says why), or None
        when nothing compiles in the background."""
        background = self.background
        if background is None:
            return None
        now = time.monotonic()
        if not wait and now < self._next_poll:
            return "running"
        self._next_poll = now + 0.5
        status = background.wait(timeout) if wait else background.poll()
        if status != "running":
            torch.set_num_threads(self._threads)
        if status == "failed":
            self.background = None
            background.stop()
            log.warning("compiled-spec: compiling the full graphs failed (%s; log: %s); decoding stays in eager",
                        background.failure(), background.log)
        elif status == "ready":
            full, self.background = self._full_runner, None  # one try: a failed switch is not retried every step
            try:
                self.switch_runner(full, [full.warm_up_call(*graph) for graph in self.warm_up_graphs(full)])
            except Exception as error:
                log.warning("compiled-spec: switching to the full graphs failed (%s: %s); decoding stays in eager",
                            type(error).__name__, error)
                return "failed"
            if self._show_progress:
                tqdm.write(f"compiled-spec: switched to full graphs after {self.steps_run} steps, "
                           f"{time.perf_counter() - background.started:.0f} s after the start", file=sys.stderr)
        return status

    def graph_mode_run(self) -> str:
        """The graph mode(s) the steps so far ran in: "full", or for a tiered start "eager, then full from step N" or
        "eager (full compiling in the background)"."""
        mode = self.runner.mode.value
        if self.switches:
            return f"eager, then {mode} from step {self.switches[0] + 1}"
        if self.background is not None:
            return f"{mode} (full compiling in the background)"
        return mode

    def switch_runner(self, runner: StepRunner, calls: list[tuple] = ()) -> None:
        """Between two steps: the next steps run on `runner`, which must be bound to this engine's state. The step
        is a pure function of that state, so the switch changes no token and no acceptance count. `calls`:
        (function, args) of graphs to load beforehand (packages are loaded without being run)."""
        if runner.state is not self.state:
            raise ValueError("the runner must be bound to this engine's state")
        for function, args in calls:
            runner.load(function, args)
        self.runner = runner
        self.switches.append(self.steps_run)
        if self.chooser:  # the seconds measured were the old runner's: each k is timed again on its first step
            self.chooser.seconds.clear()

    def fall_back(self) -> None:
        """Between two steps: the next steps run in the next safer graph mode (full, piecewise -> compile -> eager),
        compiled on its first call. A full graph still compiling in the background is dropped."""
        mode = SAFER_MODE.get(self.runner.mode, GraphMode.EAGER)
        if self.background is not None:
            self.background.stop()
            self.background = None
        self._full_runner = None
        self.constants = self.constants._replace(opaque_attention=mode == GraphMode.PIECEWISE)
        runner = StepRunner(self.model, self.state, self.constants, mode, draft_lengths=self.runner.draft_lengths,
                            prefill_width=self.prefill_buckets[-1], batch_size=self.batch_buckets[-1])
        self.switch_runner(runner)
        self.fallbacks.append(mode)

    def _time_steps(self, rounds: int = 9) -> None:
        """Seconds per step of every (bucket, k) over free slots: the fastest of several rounds that take every k
        in turn, so a slow moment of the machine (noise only ever adds time) lands on all of them or none."""
        for size in self.batch_buckets:
            for k in range(self.k + 1):  # first calls: allocations, lazy kernel set-up
                for _ in range(2):
                    self.runner.step(size, k)
            best = [float("inf")] * (self.k + 1)
            for _ in range(rounds):
                for k in range(self.k + 1):
                    begin = time.perf_counter()
                    self.runner.step(size, k)
                    self.state.step_emitted[:size].tolist()  # the host copy a live step makes
                    best[k] = min(best[k], time.perf_counter() - begin)
            for k, seconds in enumerate(best):
                self.chooser.seconds[(size, k)] = seconds

    def _calibrate(self, prompt_ids: list[int], max_tokens: int = 48) -> None:
        """Decodes one greedy request with every draft slot and seeds the acceptance estimates from it."""
        output = RequestOutput(prompt_token_ids=list(prompt_ids), stats=SpecStats(self.k))
        request = Request(-1, list(prompt_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, output)
        chooser, self.chooser = self.chooser, None  # every step drafts K
        try:
            self.admit(request)
            while self.slots:
                self.step()
        finally:
            self.chooser = chooser
        chooser.seed_acceptance(output.stats.accepted_per_position, output.stats.verified_per_position)

    def run(self, requests: list[Request], on_tokens: TokenCallback | None = None) -> None:
        """Decodes a known list of requests to the end, recording every step in step_log and step_seconds."""
        queue = deque(requests)
        while queue or self.slots:
            while queue and self.has_free_slot():
                self.admit(queue.popleft(), on_tokens)
            if self.slots:
                record = self.step(on_tokens)
                self.step_log.append(record.lanes)
                self.step_seconds.append(record.seconds)

    def has_free_slot(self) -> bool:
        return len(self.slots) < self.config.max_batch_size

    def admit(self, request: Request, on_tokens: TokenCallback | None = None) -> list[Request]:
        """Prefills `request` into the next free slot (between steps); returns it if its first token finished it."""
        if not self.has_free_slot():
            raise RuntimeError("admit() needs a free slot; check has_free_slot() first")
        slot = len(self.slots)
        params = request.params
        state = self.state
        sampled = params.temperature >= MIN_SAMPLING_TEMPERATURE  # a tinier one would overflow the logits
        state.temperature[slot] = float(params.temperature) if sampled else 0.0
        state.top_k[slot] = params.top_k
        state.top_p[slot] = float(params.top_p)
        state.seeds[slot] = request.seed
        state.ignore_eos[slot] = params.ignore_eos
        state.max_new_tokens[slot] = params.max_tokens
        state.generated[slot] = 0
        state.done[slot] = False
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
        prefill = self.runner.prefill if bucketed else self.runner.prefill_eager
        drafts = self._prefill_drafts()
        prefill(torch.tensor([slot], device=device), prompt, torch.tensor([length], device=device), drafts)
        self.eager_prefills += not bucketed
        request.valid_drafts = drafts
        self.slots.append(request)
        finished, _ = self._collect(slot + 1, on_tokens, first_slot=slot, record_stats=False)
        return finished

    def _prefill_drafts(self) -> int:
        """K, or with auto the k of its last step: drafts past the k the next step verifies would cost a prefill
        one draft depth over the prompt each (the depths past k then hold none of its rows)."""
        return self.last_num_drafts if self.chooser and self.last_num_drafts is not None else self.k

    def step(self, on_tokens: TokenCallback | None = None) -> StepRecord:
        """One speculative step over every admitted request; finished requests leave their slots."""
        self.poll_background()
        start = time.perf_counter()
        bucket = pick_bucket(self.batch_buckets, len(self.slots))
        batch = self.runner.batch_for(bucket, len(self.slots))
        k = self.chooser.choose(bucket) if self.chooser else self.k
        self.last_num_drafts = k
        verified = [min(k, request.valid_drafts) for request in self.slots]
        divergence = None
        checked = bool(self.canary and self.runner.mode != GraphMode.EAGER and self.canary.due(self.steps_run + 1))
        if checked:
            divergence = self.canary.checked_step(self, batch, k if self.chooser else None, self.steps_run + 1)
        elif self.chooser:
            self.runner.step(batch, k)
        else:
            self.runner.step(batch)
        finished, lanes = self._collect(len(self.slots), on_tokens, first_slot=0, record_stats=True,
                                        num_drafts=k, verified=verified)
        seconds = time.perf_counter() - start
        self.steps_run += 1
        if self.canary:
            self.canary.observe(self.steps_run, seconds, checked)
        if self.chooser:
            self.chooser.observe_step(bucket, k, seconds, [(v, accepted) for v, (_, accepted) in zip(verified, lanes)])
        return StepRecord(finished, lanes, seconds, k, verified, divergence)

    def abort(self, index: int) -> Request | None:
        """Frees the slot of the running request with this index (between steps); None if none runs."""
        for slot, request in enumerate(self.slots):
            if request.index == index:
                request.output.finish_reason = "abort"
                if self.tokenizer is not None:
                    request.output.text = self.tokenizer.decode(request.output.token_ids, skip_special_tokens=True)
                self._free(slot)
                return request
        return None

    def _collect(self, end: int, on_tokens, first_slot: int, record_stats: bool, num_drafts: int = 0,
                 verified: list[int] | None = None):
        """Reads what slots first_slot..end-1 emitted (one device-to-host copy) and frees finished slots.

        num_drafts: the k of the step; verified: per lane, the drafts it verified. Returns the finished requests
        and, per lane, (request index, accepted drafts).
        """
        s = self.state
        packed = torch.cat(
            [s.step_tokens[first_slot:end], s.step_emitted[first_slot:end, None],
             s.step_accepted[first_slot:end, None], s.done[first_slot:end, None].long()], dim=1
        ).tolist()
        finished, finished_slots, lanes = [], [], []
        for offset, row in enumerate(packed):
            slot = first_slot + offset
            request = self.slots[slot]
            tokens, count, accepted, done = row[: self.k + 1], row[-3], row[-2], bool(row[-1])
            if record_stats:
                lanes.append((request.index, accepted))
                if self.k > 0:
                    request.output.stats.record(accepted, verified[offset], num_drafts)
                request.valid_drafts = num_drafts
            kept = len(request.output.token_ids)
            stopped = self._append(request, tokens[:count])
            new_tokens = request.output.token_ids[kept:]  # a stop string drops the tokens after it
            if on_tokens is not None and new_tokens:
                on_tokens(request.index, new_tokens)
            if done or stopped:
                self._finish(request, stopped)
                finished.append(request)
                finished_slots.append(slot)
        for slot in reversed(finished_slots):
            self._free(slot)
        return finished, lanes

    def _append(self, request: Request, new_tokens: list[int]) -> bool:
        """Adds tokens; returns True when a stop string appeared (tokens after it are dropped)."""
        output = request.output
        stops = request.params.stop
        if not stops or self.tokenizer is None:
            output.token_ids.extend(new_tokens)
            return False
        for token in new_tokens:
            output.token_ids.append(token)
            text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            cut = min((text.find(stop) for stop in stops if stop in text), default=-1)
            if cut >= 0:
                output.text = text[:cut]
                return True
        return False

    def _finish(self, request: Request, stopped: bool) -> None:
        output = request.output
        if stopped:
            output.finish_reason = "stop"
            return
        eos_hit = bool(output.token_ids) and output.token_ids[-1] in self.eos_ids and not request.params.ignore_eos
        output.finish_reason = "stop" if eos_hit else "length"
        if self.tokenizer is not None:
            output.text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)

    def _free(self, slot: int) -> None:
        last = len(self.slots) - 1
        if slot != last:
            move_slot(self.state, last, slot)
            self.slots[slot] = self.slots[last]
        self.slots.pop()
        self.state.done[last] = True

