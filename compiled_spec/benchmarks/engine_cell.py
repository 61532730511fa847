"""One engine cell: LLM(graph_mode, k, batch size) on the workload, timed after warm-up. Runs in a worker process."""

from __future__ import annotations

import statistics
import time

from .bandwidth import main_weight_bytes
from .workload import digest


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def cell_buckets(choice: str, mode: str, batch: int, prompt_ids: list, max_seq_len: int) -> tuple:
    """(batch_buckets, prefill_buckets) of a cell; None: the engine's own.

    minimal: the cell's batch size and one prefill bucket, max_seq_len (every prompt is padded to it);
    workload: the cell's batch size and those of the engine's default prefill buckets (for this graph mode, on CPU)
    that the prompts fall in, so each prompt is padded, or prefilled in eager past the largest, exactly as a default
    engine does it, without compiling buckets no prompt uses.
    """
    from compiled_spec.config import GraphMode
    from compiled_spec.engine.buckets import compiled_prefill_limit, default_prefill_buckets, pick_bucket

    if choice == "default":
        return None, None
    if choice == "minimal":
        return (batch,), (max_seq_len,)
    ladder = default_prefill_buckets(max_seq_len, compiled_prefill_limit("cpu", GraphMode(mode)))
    used = {pick_bucket(ladder, len(ids)) for ids in prompt_ids if len(ids) <= ladder[-1]}
    return (batch,), tuple(sorted(used or {ladder[0]}))


def drafts_label(drafts) -> str:
    """A chain's k ("2"), or "tree" for the token tree's step."""
    return "tree" if drafts.tree else str(drafts.k)


def fixed_k_in_the_same_process(llm, prompt_ids: list, params, repeats: int) -> dict:
    """k = auto against each chain (and tree) it chooses from, forced, on the same engine and graphs in this process
    (tokens/s of separate processes differ by more than the chooser's margins on this kind of machine); runs
    interleaved, best of `repeats` each."""
    from compiled_spec import SamplingParams
    from compiled_spec.engine.draft_timing import FixedDrafts

    engine = llm.engine
    chooser = engine.chooser
    best: dict[str, float] = {}
    for _ in range(repeats):
        for drafts in [*chooser.candidates, "auto"]:
            with engine.drafting(chooser if drafts == "auto" else FixedDrafts(drafts)):
                label = "auto" if drafts == "auto" else drafts_label(drafts)
                # Untimed: a request is admitted with the k of the step before, which is now this run's own.
                llm.generate(prompt_ids[:1], SamplingParams(max_tokens=2, ignore_eos=True))
                start = time.perf_counter()
                outputs = llm.generate(prompt_ids, params)
                rate = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
                best[label] = max(best.get(label, 0.0), rate)
    fixed = {label: rate for label, rate in best.items() if label != "auto"}
    best_fixed = max(fixed, key=fixed.get)
    return {"same_process_tokens_per_s": best, "same_process_best_fixed_k": best_fixed,
            "same_process_auto_over_best_fixed_k": best["auto"] / fixed[best_fixed]}


def measure_engine(spec: dict) -> dict:
    from compiled_spec import LLM, HiSparseConfig, SamplingParams
    from compiled_spec.model import cpu_kernels
    from compiled_spec.model.half_weight_linear import draft_weight_dtype
    from compiled_spec.compiler import torch_patches
    from compiled_spec.compiler.step_runner import graphs_made

    mode, k, batch = spec["graph_mode"], spec["num_speculative_tokens"], spec["batch_size"]
    prompt_ids, max_seq_len = spec["prompt_ids"], spec["max_seq_len"]
    batch_buckets, prefill_buckets = cell_buckets(spec["buckets"], mode, batch, prompt_ids, max_seq_len)
    start = time.perf_counter()
    llm = LLM(
        spec["model"],
        num_speculative_tokens=k,
        graph_mode=mode,
        max_batch_size=batch,
        max_seq_len=max_seq_len,
        batch_buckets=batch_buckets,
        prefill_buckets=prefill_buckets,
        show_progress=False,
        hisparse=HiSparseConfig(**spec["hisparse"]) if spec.get("hisparse") else None,
        draft_vocab_size=spec.get("draft_vocab_size"),
        mtp=spec.get("mtp"),
        draft_dtype=spec.get("draft_dtype"),
        dequantize=spec.get("dequantize", False),
        quantize=spec.get("quantize"),
        draft_tree=spec.get("draft_tree"),
        drafter=spec.get("drafter"),
    )
    setup_s = time.perf_counter() - start
    engine = llm.engine

    # One short untimed request: first-call costs of eager kernels, allocator, tokenizer.
    llm.generate([prompt_ids[0]], SamplingParams(max_tokens=min(4, spec["max_tokens"]), ignore_eos=True))
    graphs_before = graphs_made(engine.runner)
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
    best = None
    for _ in range(spec["repeats"]):
        engine.step_log.clear()
        engine.step_seconds.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompt_ids, params)
        elapsed = time.perf_counter() - start
        if best is None or elapsed < best[0]:
            best = (elapsed, outputs, list(engine.step_seconds))
    elapsed, outputs, step_seconds = best
    errors = [output.error for output in outputs if output.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    same_process = fixed_k_in_the_same_process(llm, prompt_ids, params, spec["repeats"]) if engine.chooser else {}

    stats = outputs[0].stats
    for output in outputs[1:]:
        stats.merge(output.stats)
    generated = sum(len(output.token_ids) for output in outputs)
    step_ms = [1000 * seconds for seconds in step_seconds]
    packages_compiled, packages_loaded = engine.runner.packages()
    return {
        "tokens_per_s": generated / elapsed,
        "generated_tokens": generated,
        "requests": len(outputs),
        "elapsed_s": elapsed,
        "steps": len(step_ms),
        "time_in_steps_s": sum(step_seconds),  # the rest of elapsed_s: prefill, admission, Python between steps
        "step_latency_ms": {
            "p50": percentile(step_ms, 0.5),
            "p90": percentile(step_ms, 0.9),
            "mean": statistics.fmean(step_ms),
        } if step_ms else None,  # no steps when every request finished at prefill (max_tokens=1)
        "drafted": stats.drafted,
        "accepted_per_position": stats.accepted_per_position,
        "acceptance_rate_per_position": stats.acceptance_rate_per_position,
        "mean_accepted_length": stats.mean_accepted_length if k else 1.0,
        # k = auto: steps per k chosen (tree_steps: those that verified the tree; leaf_steps: those whose path
        # ended on a leaf), and the estimates it chose from (seconds per step of each chain and the tree, the
        # chains' acceptance per position, a leaf's where the chain's draft was rejected).
        "steps_per_num_drafts": {str(key): count for key, count in sorted(stats.steps_per_num_drafts.items())},
        "tree_steps": stats.tree_steps,
        "leaf_steps": stats.leaf_steps,
        "auto_step_seconds": {drafts_label(drafts): seconds
                              for (_, drafts), seconds in sorted(engine.chooser.seconds.items())}
        if engine.chooser else None,
        "auto_acceptance_estimate": list(engine.chooser.acceptance) if engine.chooser else None,
        "auto_leaf_acceptance_estimate": list(engine.chooser.leaf_acceptance) if engine.chooser else None,
        "warmup_s": engine.startup.warmup_seconds,
        "setup_s": setup_s,
        "graphs_compiled_while_timed": graphs_made(engine.runner) - graphs_before,
        # full on CPU: bucket packages compiled at warm-up, and those a warm start loaded instead.
        "packages_compiled": len(packages_compiled) + len(engine.startup.compiled_in_processes),
        "packages_loaded": len(packages_loaded) - len(engine.startup.compiled_in_processes),
        "compile_processes": engine.startup.compile_processes,
        "package_bytes": engine.runner.package_bytes(),
        "constants_bytes": engine.runner.constants_bytes(),  # the frozen weights the packages share, once
        "weight_bytes": resident_weight_bytes(llm.model),
        "weight_format": llm.weight_format,
        "batch_buckets": list(engine.batch_buckets),
        "prefill_buckets": list(engine.prefill_buckets),
        # full on CPU: the one prefill package's (lowest, highest) prompt width; None: a graph per prefill bucket.
        "prefill_widths": list(engine.runner.prefill_widths) if engine.runner.prefill_widths else None,
        "step_batches": list(engine.runner.step_batches) if engine.runner.step_batches else None,
        "output_digests": [digest(output.token_ids) for output in outputs],
        # What the engine really runs with (None: dense attention).
        "hisparse_top_k_tokens": engine.constants.attention.config.top_k_tokens if engine.constants.attention.config else None,
        "hot_buffer_rows": engine.state.hisparse.hot_keys[0].shape[1] - 1 if engine.state.hisparse else None,
        "hisparse_scorer": scorer_in_use(llm.model) if engine.constants.attention.config else None,
        "main_weight_bytes": main_weight_bytes(llm.model),
        "draft_vocab_size": None if llm.model.draft_vocab is None or llm.config.drafter != "mtp"
        else llm.model.draft_vocab.numel(),
        "draft_tree": list(llm.config.draft_tree) if llm.config.draft_tree else None,
        "drafter": llm.config.drafter if llm.config.max_drafts else None,
        "draft_weight_dtype": draft_weight_dtype(llm.model),
        "cpu_kernels": cpu_kernels.status(),  # "built", "not built: <why>", or "not needed" (eager)
        "torch_patches": torch_patches.installed(),  # name -> key or "as shipped"; empty in eager
        **same_process,
    }


def resident_weight_bytes(model) -> int:
    """Bytes the model's weights hold in memory: every parameter and buffer once (a tensor under two names, e.g. a
    tied head, counts once), packed matrices at their packed size (their parts are the module's buffers)."""
    tensors = [*model.parameters(), *(buffer for buffer in model.buffers() if buffer is not None)]
    return sum({(t.data_ptr(), t.nbytes): t.nbytes for t in tensors}.values())


def scorer_in_use(model) -> str:
    """'indexer' when the first layer scores with trained lightning-indexer weights, else 'keys'."""
    from compiled_spec.hisparse.indexer import LightningIndexer

    return "indexer" if isinstance(model.layers[0].self_attn.indexer, LightningIndexer) else "keys"
