"""Getting an engine's graphs ready: warm-up, compiling in child processes, the tiered start, falling back.

Warm-up compiles every graph once, before any request is admitted. Full on CPU compiles missing packages in child
processes; with a tiered start the engine decodes in eager meanwhile and switches to the full graphs between two
steps. The step is a pure function of the decode state, so a switch changes no token and no acceptance count.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from ..compiler.aot_packages import discard_package, package_damage
from ..compiler.background_compile import BackgroundCompile, compile_worker_count, earlier_failure, failed_file
from ..compiler.step_runner import StepRunner
from ..config import GraphMode
from ..speculative.step import Drafts
from .draft_timing import time_steps
from .engine_spec import EngineSpec

if TYPE_CHECKING:
    from .engine import Engine

COMPILE_WORKER = "compiled_spec.engine.compile_worker"  # the module a compile process runs (python -m)

log = logging.getLogger("compiled_spec.engine")


@dataclass
class StartOptions:
    calibration_prompt: list[int] | None = None  # what k = auto decodes at warm-up to seed its acceptance estimates
    spec: EngineSpec | None = None  # this engine's (full on CPU): compile processes build the same engine from it
    tiered_start: bool = False  # warm-up decodes in eager while missing packages compile (needs spec)
    compile_workers: int | None = None  # processes that compile missing packages (None: one per core)


class GraphStartup:
    """Makes and swaps the graphs of one engine's runner."""

    def __init__(self, engine: Engine, options: StartOptions):
        self.engine = engine
        self.options = options
        self.warmup_seconds = 0.0
        self.compiled_in_processes: list[str] = []  # packages child processes compiled for warm-up (then loaded here)
        self.compile_processes = 1  # how many processes compiled them
        self.background: BackgroundCompile | None = None
        self._full_runner: StepRunner | None = None
        self._next_poll, self._show_progress, self._threads = 0.0, False, 1

    def warm_up_graphs(self, runner: StepRunner | None = None) -> list[tuple[str, int, Drafts]]:
        """(kind, size, drafts) of every graph warm-up makes for `runner` (default: the engine's): each batch bucket
        for every chain or tree the runner steps with (runner.step_drafts) and, if the runner compiles prefill,
        each prefill bucket (or, full on CPU, one prefill package for every width up to the largest) for every k
        of those (runner.draft_lengths).

        Full on CPU: the one step package for every batch (the longest compile, so it goes first), then the one
        prefill package; compile processes take them in this order."""
        engine = self.engine
        runner = runner or engine.runner
        steps = runner.step_drafts
        prefill_drafts = [Drafts(k) for k in runner.draft_lengths]
        sizes = [runner.step_batches[1]] if runner.step_batches else list(reversed(engine.batch_buckets))
        graphs = [("step", size, drafts) for size in sizes for drafts in steps]
        if runner.prefill_widths:  # one package covers every width (full on CPU); the longest compiles go first
            prefills = [("prefill", runner.prefill_widths[1], drafts) for drafts in prefill_drafts]
            return graphs + prefills if runner.step_batches else prefills + graphs
        if runner.compiles_prefill:
            graphs += [("prefill", size, drafts)
                       for size in reversed(engine.prefill_buckets) for drafts in prefill_drafts]
        return graphs

    def warm_up(self, show_progress: bool = True) -> None:
        """Compiles every graph of warm_up_graphs() once, before any request is admitted. With auto it then times
        every (bucket, k) graph and seeds the acceptance estimates by decoding the calibration prompt.

        With a spec (full on CPU), packages that are missing compile in child processes, one graph per
        process at a time (compile_workers). With tiered_start the engine decodes in eager meanwhile and switches
        between two steps (poll_background); without, warm-up waits for them."""
        engine = self.engine
        if engine.config.graph_mode == GraphMode.EAGER and not engine.chooser:
            return
        if engine.slots:
            raise RuntimeError("warm_up() must run before requests are admitted")
        start = time.perf_counter()
        if engine.config.graph_mode != GraphMode.EAGER:
            graphs = self.warm_up_graphs()
            paths = [engine.runner.package_path(*graph) for graph in graphs]  # None where nothing is packaged
            damaged = {path: damage for path in paths if path is not None and path.exists()
                       and (damage := package_damage(path))}
            if damaged:
                log.warning("compiled-spec: compiled packages in %s are damaged (%s); compiling them again",
                            next(iter(damaged)).parent, "; ".join(f"{p.name}: {d}" for p, d in damaged.items()))
                for path in damaged:
                    discard_package(path)
            if self.options.tiered_start and not all(path and path.exists() for path in paths):
                if (failure := earlier_failure(paths)) is None:
                    self._start_in_eager(graphs, paths, show_progress)
                else:  # the same packages failed before: decode in eager, and say so once
                    engine.use_runner(self._eager_runner(), initial=True)
                    log.warning("compiled-spec: the full graphs failed to compile in an earlier run (%s); decoding "
                                "in eager. Remove %s to try again", failure, failed_file(paths))
            else:
                self._compile_in_processes(graphs, paths, show_progress)
                packaged = all(path is not None and path.exists() for path in paths)
                self._compile_graphs(show_progress, "loading buckets" if packaged else "compiling buckets")
        if engine.chooser:
            time_steps(engine.runner, engine.state, engine.chooser, engine.batch_buckets)
            if self.options.calibration_prompt:
                engine.calibrate(self.options.calibration_prompt)
        self.warmup_seconds = time.perf_counter() - start

    def _compile_graphs(self, show_progress: bool, description: str) -> None:
        runner = self.engine.runner
        bar = tqdm(self.warm_up_graphs(), desc=description, unit="graph", disable=not show_progress)
        for kind, size, drafts in bar:
            label = f" {drafts}" if self.engine.chooser else ""
            covered = runner.step_batches if kind == "step" else runner.prefill_widths
            sizes = f"{covered[0]}-{size}" if covered and size == covered[1] else str(size)  # one package, a range
            bar.set_postfix_str(f"{kind} {'batch' if kind == 'step' else 'prompt'}={sizes}{label}")
            self.compile_graph(kind, size, drafts)

    def _compile_in_processes(self, graphs: list, paths: list, show_progress: bool) -> None:
        """Compiles the missing packages in compile_workers child processes at once, where there are 2 or more of
        each (one graph's compile is single-threaded); _compile_graphs then loads them. If that fails, one warning,
        and _compile_graphs compiles them here (and raises the error, if it is not the children's own)."""
        if self.options.spec is None:
            return
        missing = [path for path in paths if path is not None and not path.exists()]
        workers = compile_worker_count(self.options.compile_workers, len(missing))  # at most one per missing graph
        if workers < 2:
            return
        children = BackgroundCompile(COMPILE_WORKER, dict(spec=self.options.spec), graphs, paths, show_progress,
                                     workers=workers,
                                     niceness=0, description=f"compiling buckets in {workers} processes")
        status = children.wait()
        children.join()  # its processes still wind down after the last package: decoding beside them stalls
        self.compile_processes = workers
        self.compiled_in_processes = [path.name for path in missing if path.exists()]
        if status != "ready":
            log.warning("compiled-spec: compiling in %d processes failed (%s; log: %s); compiling here instead",
                        workers, children.failure(), children.log)
            children.stop()

    def compile_graph(self, kind: str, size: int, drafts: Drafts) -> None:
        """Makes one graph of warm_up_graphs() by calling it once over free slots (every slot is free and marked
        done, so nothing live is touched)."""
        engine = self.engine
        if engine.slots:
            raise RuntimeError("compile_graph() needs every slot free")
        function, args = engine.runner.warm_up_call(kind, size, drafts)
        with torch.inference_mode():
            function(*engine.runner.bound, *args)
        engine.state.done[0] = True  # a prefill over slot 0 marked it live

    def _start_in_eager(self, graphs: list, paths: list, show_progress: bool) -> None:
        """graphs (and their package paths): all of them (the child skips those whose package exists), so that every
        process that starts while some are still missing names the same compile and follows it."""
        self._full_runner = self.engine.runner
        self.engine.use_runner(self._eager_runner(), initial=True)
        missing = sum(not path.exists() for path in paths)
        self.background = BackgroundCompile(COMPILE_WORKER, dict(spec=self.options.spec), graphs, paths, show_progress,
                                            workers=compile_worker_count(self.options.compile_workers, missing),
                                            beside_text=True)
        self._show_progress = self.background.live_bar  # a line written mid-stream would land inside the text
        # Decode on one thread meanwhile: a kernel's threads wait at a barrier for the one the compile displaced
        # (docs/graph-modes.md). The packages use the count they had.
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def _eager_runner(self) -> StepRunner:
        engine = self.engine
        return StepRunner(engine.model, engine.state, engine.constants, GraphMode.EAGER,
                          step_drafts=engine.runner.step_drafts)

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
                tqdm.write(f"compiled-spec: switched to full graphs after {self.engine.steps_run} steps, "
                           f"{time.perf_counter() - background.started:.0f} s after the start", file=sys.stderr)
        return status

    def graph_mode_run(self) -> str:
        """The graph mode(s) the steps so far ran in: "full", or for a tiered start "eager, then full from step N" or
        "eager (full compiling in the background)", or after the canary fell back "compile (the graph canary fell back
        to it at step N)"."""
        mode = self.engine.runner.mode.value
        if self.engine.fallbacks:
            return f"{mode} (the graph canary fell back to it at step {self.engine.switches[-1] + 1})"
        if self.engine.switches:
            return f"eager, then {mode} from step {self.engine.switches[0] + 1}"
        if self.background is not None:
            return f"{mode} (full compiling in the background)"
        return mode

    def switch_runner(self, runner: StepRunner, calls: list[tuple] = ()) -> None:
        """Between two steps: the engine steps on `runner` next. `calls`: (function, args) of graphs to load beforehand
        (packages are loaded without being run)."""
        for function, args in calls:
            runner.load(function, args)
        self.engine.use_runner(runner)

    def stop_background(self) -> None:
        """Drops a full graph still compiling in the background (the engine falls back)."""
        if self.background is not None:
            self.background.stop()
            self.background = None
        self._full_runner = None
