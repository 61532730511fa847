"""Wires the pure step and prefill functions to a graph mode.

eager: plain PyTorch, the reference. compile: inductor, no graph capture. piecewise: inductor with
graphs split at attention (cache write + attention is an opaque custom op); on CUDA the pieces are
replayed as CUDA graphs and attention runs between them, on CPU the pieces are compiled code and
attention runs as the op's own kernel. full: the whole step as one max-autotune graph per bucket,
replayed by cudagraph trees on CUDA; on CPU frozen (so max-autotune tunes GEMMs over constant weights)
and compiled ahead of time into packages that later processes load (compiler/aot_packages.py): one step package
for every batch up to the largest bucket, one prefill package for every prompt width up to the largest bucket.

In piecewise and full the runner captures the state's buffers once and calls every graph on
exactly those buffers, as a replayed CUDA graph would: anything that rebinds a state field
instead of writing into its buffer is invisible to the graph (and the passes make sure the step
itself never does).

The first compiled runner (or spec_backend) installs compiled-spec's changes to torch (torch_patches); eager
changes nothing in torch.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext
from pathlib import Path

import torch

from ..config import GraphMode
from ..model import cpu_kernels
from ..model.causal_lm import CausalLM
from ..model.layers import COMPILED_ATTENTION_MAX_ROWS, DECODE_ATTENTION_MAX_ROWS
from ..passes import SpecPassManager, default_passes
from ..passes.graph_inputs import named_inputs, source_names
from ..passes.manager import PassContext
from ..speculative.state import DecodeState
from ..speculative.step import Drafts, StepConstants, prefill, speculative_step, state_writes
from . import cpu_partitions, torch_patches, weight_store
from .aot_packages import AheadOfTimeCompiled, DynamicSize, model_digest

# The shortest prompt width the one prefill package of full on CPU takes: at fewer rows attention takes another path
# (decode_attention or grouped_attention), a branch a package of every length cannot hold. Shorter prompts are
# padded to it.
PACKAGED_PREFILL_MIN_WIDTH = max(DECODE_ATTENTION_MAX_ROWS, COMPILED_ATTENTION_MAX_ROWS) + 1
# Below this largest batch the batch buckets keep static packages: a range of 2 sizes does not pay for the dynamic
# batch's longer compile (its traces carry the batch as a symbol).
PACKAGED_STEP_MIN_LARGEST_BATCH = 3

# Inductor inlines a pointwise node into each of its uses until the inlined function has this many ops (default: 50
# on CPU), and lowering evaluates the inlined function again for each use. The sampler's counter-based hash
# (speculative/rng.py) uses every intermediate twice (x ^ (x >> 16)), three mix32 deep, so its expression trees
# double per stage and lowering's work with them. Realized at 16 ops, the draw compiles several times faster and runs
# as fast (docs/graph-modes.md, "What a graph's compile costs, and what was cut").
REALIZE_OPCOUNT_THRESHOLD = 16


def inductor_options(mode: GraphMode, device: torch.device, dtype: torch.dtype = torch.float32) -> dict:
    """Inductor's options for a graph mode (the patches torch_patches installs come on top, in every mode).

    In 16-bit dtypes inductor keeps fused intermediates in float32 where eager rounds each op's result, and greedy
    tokens then differ from eager's; emulate_precision_casts rounds where eager does (docs/graph-modes.md, "In
    bfloat16 and float16")."""
    return {**_mode_options(mode, device), "realize_opcount_threshold": REALIZE_OPCOUNT_THRESHOLD,
            **({"emulate_precision_casts": True} if dtype in (torch.bfloat16, torch.float16) else {})}


def _mode_options(mode: GraphMode, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    if mode == GraphMode.FULL:
        options = dict(torch._inductor.list_mode_options("max-autotune"))
        if not cuda:
            # Packaged ahead of time: no graph replay on CPU, and freezing for the C++ GEMM templates, the only GEMM
            # choice. Their micro-kernel, as torch_patches changes it, keeps its accumulators (and on AVX2 its weight
            # vectors) in registers and prefetches the weights over several rows (micro_gemm_kernel): a step that
            # verifies k+1 rows then streams them about as fast as a one-row step does. With the template as torch
            # ships it, ATen's GEMMs are faster over several rows (docs/cpu-performance.md, "GEMMs"). ATen's choice
            # pre-packs its weight into an opaque MKL-DNN tensor, which cannot be stored outside the package
            # (weight_store), so the template is the only choice; not benchmarking two also shortens the compile.
            options.update({"freezing": True, "triton.cudagraphs": False, "max_autotune_gemm_backends": "CPP"})
        else:
            # All or nothing: one captured graph per step. A step that cannot be captured whole raises instead of
            # being split into partitions (the piecewise fault class) or run uncaptured.
            options.update({"graph_partition": False, "triton.cudagraph_or_error": True})
        return options
    if mode == GraphMode.PIECEWISE:
        # On CPU too: partitions_on_cpu makes the partition functions CUDA captures, and runs them uncaptured.
        return {
            "graph_partition": True,
            "custom_should_partition_ops": list(cpu_partitions.PARTITION_OPS),
            "triton.cudagraphs": True,
        }
    return {"triton.cudagraphs": False}


def spec_backend(options: dict, manager: SpecPassManager):
    """A torch.compile backend: inductor with the given options and our passes installed."""
    torch_patches.install()

    cpu_partitioned = options.get("graph_partition") and options.get("custom_should_partition_ops")

    def backend(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx  # here: an eager start never pays for importing it

        partitions = cpu_partitioned and not any(
            isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
        with named_inputs(source_names(gm)), cpu_partitions.partitions_on_cpu() if partitions else nullcontext():
            return compile_fx(gm, example_inputs, config_patches={**options, "post_grad_custom_post_pass": manager})

    return backend


def over_lanes(step_function):
    """step_function(model, state, constants, batch_size, ...) called with a tensor of batch_size elements instead of
    the number (its values are never read), so that export can make the batch a dynamic dimension."""

    @functools.wraps(step_function)
    def step(model, state, constants, lanes: torch.Tensor, *args):
        return step_function(model, state, constants, lanes.shape[0], *args)

    return step


class StepRunner:
    """Calls the step and prefill for one engine, eagerly or compiled."""

    def __init__(
        self,
        model: CausalLM,
        state: DecodeState,
        constants: StepConstants,
        mode: GraphMode,
        step_drafts: tuple[Drafts, ...],
        passes: list | None = None,
        step_function=speculative_step,
        prefill_function=prefill,
        prefill_width: int | None = None,
        batch_size: int | None = None,
    ):
        """step_drafts: what step(batch_size, drafts) is called with (the chain of the state's K draft slots or the
        token tree; with auto every chain 0..K and the tree); prefill(..., k) is called with each of their k (auto
        admits a request with the k it decodes with). Each is a graph of its own, with the writes it makes checked
        by its own passes. prefill_width: the largest prompt width prefill is called with (the largest prefill
        bucket); with it, full on CPU compiles one prefill package (per k) for every width from
        PACKAGED_PREFILL_MIN_WIDTH up to it (prefill_widths).
        batch_size: the largest batch step is called with (the largest batch bucket); with it, full on CPU compiles
        one step package (per chain or tree) for every batch from 1 up to it (step_batches), when it is
        PACKAGED_STEP_MIN_LARGEST_BATCH or more. (Batch 1's own package would be one more graph to compile at every
        cold start; the trade is measured in docs/graph-modes.md.)"""
        self.mode = mode
        self.state = state
        self.step_drafts = step_drafts
        self.draft_lengths = tuple(sorted({drafts.k for drafts in step_drafts}))  # the k prefill is called with
        self.compiles_prefill = mode != GraphMode.EAGER
        captures = mode in (GraphMode.PIECEWISE, GraphMode.FULL)
        # A shallow copy: the same buffers, but later rebinding of a field on `state` does not reach it.
        graph_state = dataclasses.replace(state) if captures else state
        self.managers: dict[str, SpecPassManager] = {}
        self.bound = (model, graph_state, constants)
        self._eager_prefill = prefill_function
        self._steps: dict[Drafts, object] = {drafts: step_function for drafts in step_drafts}  # -> its step graph
        self._prefills: dict[int, object] = {k: prefill_function for k in self.draft_lengths}  # k -> its prefill graph
        # (lowest, highest) prompt width of the one prefill package, or None: a graph per prefill bucket.
        self.prefill_widths: tuple[int, int] | None = None
        # (lowest, highest) batch of the one step package, or None: a graph per batch bucket.
        self.step_batches: tuple[int, int] | None = None
        self._lanes: dict[int, torch.Tensor] = {}  # batch size -> the tensor the one step package takes for it
        if mode == GraphMode.EAGER:
            return
        torch_patches.install()
        device = state.seq_lens.device
        if device.type == "cuda":
            for tensor in graph_state.tensors() + [constants.rope_cos, constants.rope_sin, constants.eos_ids]:
                torch._dynamo.mark_static_address(tensor)
        options = inductor_options(mode, device, constants.rope_cos.dtype)  # the rope tables have the engine's dtype
        if device.type == "cpu" and not options.get("freezing"):
            cpu_kernels.load()  # full on CPU builds it where it loads or compiles a package (aot_packages.py)
        model_key = model_digest(model, constants) if options.get("freezing") else None
        if options.get("freezing") and prefill_width is not None and prefill_width > PACKAGED_PREFILL_MIN_WIDTH:
            self.prefill_widths = (PACKAGED_PREFILL_MIN_WIDTH, prefill_width)
        if options.get("freezing") and batch_size is not None and batch_size >= PACKAGED_STEP_MIN_LARGEST_BATCH:
            self.step_batches = (1, batch_size)

        hisparse = constants.attention.config

        def compiled(name: str, function, k: int):
            context = PassContext(
                graph_name=f"{name} ({mode.value})", state_writes=state_writes(state, constants, k),
                options={**options, **({"hisparse": repr(hisparse)} if hisparse else {}),
                         **({"decode_attention": cpu_kernels.loaded()}
                            if device.type == "cpu" and not options.get("freezing") else {}),
                         "torch_patches": torch_patches.cache_key(),
                         **({"cpu_partitions": cpu_partitions.VERSION}
                            if device.type == "cpu" and options.get("graph_partition") else {})},
            )
            manager = SpecPassManager(passes if passes is not None else default_passes(hisparse), context)
            self.managers[name] = manager
            if options.get("freezing"):
                dynamic = None
                if function is prefill_function and self.prefill_widths:
                    # prefill(slot, prompt_ids [1, width], prompt_len, k): one package for every width in range.
                    dynamic = DynamicSize(arg=1, dim=1, low=self.prefill_widths[0], high=self.prefill_widths[1])
                elif function is step_function and self.step_batches:
                    # step(lanes [batch], k, tree): one package for every batch in range.
                    function = over_lanes(function)
                    dynamic = DynamicSize(arg=0, dim=0, low=self.step_batches[0], high=self.step_batches[1])
                return AheadOfTimeCompiled(function, manager, options, model_key, dynamic)
            return torch.compile(function, fullgraph=True, dynamic=False, backend=spec_backend(options, manager))

        # Dynamo keeps one cache per function and tells these apart by backend, so each graph has its own passes.
        self._steps = {drafts: compiled(f"step {drafts}", step_function, drafts.k) for drafts in step_drafts}
        self._prefills = {k: compiled(f"prefill k={k}", prefill_function, k) for k in self.draft_lengths}

    def packages(self) -> tuple[list[str], list[str]]:
        """(compiled, loaded): the ahead-of-time packages (full on CPU) this runner has compiled and loaded."""
        packaged = self._packaged()
        return [name for f in packaged for name in f.compiled], [name for f in packaged for name in f.loaded]

    def package_bytes(self) -> int:
        """Bytes on disk of the packages this runner compiled or loaded."""
        return sum((f.folder / name).stat().st_size for f in self._packaged() for name in f.compiled + f.loaded)

    def bound_constants(self) -> dict[str, torch.Tensor]:
        """digest -> tensor of the constants (frozen weights) those packages share, each stored and loaded once."""
        return {key: tensor for f in self._packaged() for key, tensor in f.bound_constants.items()}

    def constants_bytes(self) -> int:
        """Bytes on disk of bound_constants()."""
        packaged = self._packaged()
        return sum(weight_store.size(packaged[0].folder, key) for key in self.bound_constants())

    def export_traces(self) -> int:
        """Graphs Dynamo traced while this runner exported its packages (torch.cond's branches)."""
        return sum(f.export_traces for f in self._packaged())

    def _packaged(self) -> list[AheadOfTimeCompiled]:
        functions = (*self._steps.values(), *self._prefills.values())
        return [f for f in functions if isinstance(f, AheadOfTimeCompiled)]

    def warm_up_call(self, kind: str, size: int, drafts: Drafts) -> tuple:
        """(function, arguments) of the graph warm-up makes for a batch bucket (kind "step", one of step_drafts) or
        a prefill bucket (kind "prefill", over slot 0, drafting drafts.k)."""
        if kind == "prefill":
            device = self.state.seq_lens.device
            slot = torch.zeros(1, dtype=torch.int64, device=device)
            prompt = torch.zeros(1, size, dtype=torch.int64, device=device)
            return self._prefills[drafts.k], (slot, prompt, torch.ones(1, dtype=torch.int64, device=device), drafts.k)
        return self._steps[drafts], (self._batch_argument(size), *drafts)

    def batch_for(self, bucket: int, lanes: int) -> int:
        """The batch a step over `lanes` requests runs at: their batch bucket, or (the one step package of full on
        CPU, which takes every batch) their own number."""
        return lanes if self.step_batches else bucket

    def _batch_argument(self, batch_size: int):
        """What the step function takes for this batch: the number, or for the one step package a tensor of that
        length (kept, so a step allocates nothing)."""
        if self.step_batches is None:
            return batch_size
        if batch_size not in self._lanes:
            self._lanes[batch_size] = torch.zeros(batch_size, dtype=torch.int64, device=self.state.seq_lens.device)
        return self._lanes[batch_size]

    def package_path(self, kind: str, size: int, drafts: Drafts) -> Path | None:
        """Where the ahead-of-time package of that graph is kept (full on CPU), else None."""
        function, args = self.warm_up_call(kind, size, drafts)
        return function.package_path(self.bound[1], args) if isinstance(function, AheadOfTimeCompiled) else None

    def load(self, function, args: tuple) -> None:
        """Loads the package of a warm_up_call without running it (full on CPU; the other modes compile on a call)."""
        if isinstance(function, AheadOfTimeCompiled):
            function.prepare(*self.bound, *args)

    @torch.inference_mode()
    def step(self, batch_size: int, drafts: Drafts):
        """One step that verifies and drafts `drafts`, one of step_drafts."""
        return self._steps[drafts](*self.bound, self._batch_argument(batch_size), *drafts)

    @torch.inference_mode()
    def prefill(self, slot: torch.Tensor, prompt_ids: torch.Tensor, prompt_len: torch.Tensor, k: int):
        """A prefill that drafts k tokens, one of draft_lengths."""
        return self._prefills[k](*self.bound, slot, prompt_ids, prompt_len, k)

    @torch.inference_mode()
    def prefill_eager(self, slot: torch.Tensor, prompt_ids: torch.Tensor, prompt_len: torch.Tensor, k: int):
        """A prefill in eager whatever the mode (a prompt longer than every prefill bucket, at its own length)."""
        return self._eager_prefill(*self.bound, slot, prompt_ids, prompt_len, k)


def graphs_made(runner: StepRunner) -> int:
    """Graphs Dynamo has traced in this process (less those traced inside an export), plus the packages (full
    on CPU) `runner` compiled or loaded."""
    compiled, loaded = runner.packages()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - runner.export_traces() + len(compiled) + len(loaded)
