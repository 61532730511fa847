"""Plans the cells of a sweep, runs each in a fresh worker process, and joins their records.

A cell is one engine configuration (graph mode, k, batch size) or one anchor (a transformers baseline at a
batch size). Every cell generates the same number of tokens for the same prompt token ids, greedy.

With several rounds, every cell runs once per round, in a fresh process each time, and keeps its fastest round. On a
shared 2-core VM the same compiled graph runs at different speeds in different processes (docs/benchmarks.md), and
the machine slows and recovers over minutes; rounds spread both over every cell alike, so cells compare side by
side. The first round compiles what the cache lacks; later rounds start warm.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from compiled_spec.loading.gguf_checkpoint import is_gguf

from . import environment, report
from .bandwidth import limit_bandwidth, measure_in_subprocess, plain_cells_over_limit
from .anchors import ANCHORS, unavailable_reason
from .workload import auto_max_seq_len, prompt_token_ids

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SweepOptions:
    model: Path
    graph_modes: list[str]
    num_speculative_tokens: list  # numbers of drafts, and "auto"
    batch_sizes: list[int]
    anchors: list[str]
    out: Path
    max_tokens: int = 128
    prompts: list | None = None  # None: the default prompts (workload.py)
    max_seq_len: int | None = None  # None: room for the longest prompt plus max_tokens
    buckets: str = "minimal"  # minimal, workload or default: engine_cell.cell_buckets
    repeats: int = 1  # timed runs in one process, best kept
    rounds: int = 1  # fresh processes per cell, one per round through all cells, best kept
    threads: int = 0  # 0: torch's default
    cache_dir: Path | None = None  # TORCHINDUCTOR_CACHE_DIR of every cell; None: a fresh one for this sweep
    cell_timeout_s: float = 1800.0
    plots: bool = True
    hisparse: dict | None = None  # HiSparseConfig fields for every engine cell; None: dense attention
    draft_vocab_sizes: list = field(default_factory=lambda: [None])  # cells with k > 0, per size; None: engine default
    draft_trees: list = field(default_factory=list)  # token trees (width tuples): cells at each one's depth, and auto
    drafters: list = field(default_factory=lambda: [None])  # cells with k > 0, per drafter; None: the engine default
    mtp: Path | None = None  # engine cells draft with these MTP modules (LLM(mtp=...)); None: the model's own
    draft_dtype: str | None = None  # engine cells' draft weight dtype (LLM(draft_dtype=...)); None: the default
    dequantize: bool = False  # engine cells widen a GGUF's quantized matrices (LLM(dequantize=True))
    quantize: str | None = None  # engine cells quantize a float checkpoint at load (LLM(quantize=...))
    command: list[str] = field(default_factory=list)


def plan(options: SweepOptions, prompt_ids: list[list[int]], max_seq_len: int) -> list[dict]:
    common = dict(model=str(options.model), prompt_ids=prompt_ids, max_tokens=options.max_tokens,
                  repeats=options.repeats, threads=options.threads)
    cells = []
    for anchor in options.anchors:
        for batch in options.batch_sizes:
            cells.append(dict(kind="anchor", name=f"{anchor} b={batch}", anchor=anchor, batch_size=batch, **common))
    shapes = [(None, options.num_speculative_tokens)]  # chains, then each tree at its depth (and auto among both)
    shapes += [(tuple(tree), [len(tree)] + (["auto"] if "auto" in options.num_speculative_tokens else []))
               for tree in options.draft_trees]
    for mode in options.graph_modes:
        for tree, ks in shapes:
            for k in ks:
                for batch in options.batch_sizes:
                    drafting = k == "auto" or k > 0
                    for size, drafter in itertools.product(options.draft_vocab_sizes if drafting else [None],
                                                           options.drafters if drafting and not tree else [None]):
                        name = f"{mode} k={k} b={batch}" + (f" v={size}" if size else "") + \
                            (f" tree={','.join(map(str, tree))}" if tree else "") + (f" {drafter}" if drafter else "")
                        cells.append(dict(kind="engine", name=name, graph_mode=mode, num_speculative_tokens=k,
                                          batch_size=batch, max_seq_len=max_seq_len, buckets=options.buckets,
                                          hisparse=options.hisparse, draft_vocab_size=size, draft_tree=tree,
                                          drafter=drafter, mtp=str(options.mtp) if options.mtp else None,
                                          draft_dtype=options.draft_dtype, dequantize=options.dequantize,
                                          quantize=options.quantize, **common))
    return cells


def run_worker(spec: dict, log_path: Path, env: dict, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-cell-") as scratch:
        spec_path, result_path = Path(scratch) / "spec.json", Path(scratch) / "result.json"
        spec_path.write_text(json.dumps(spec))
        with open(log_path, "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "compiled_spec.benchmarks.worker", str(spec_path), str(result_path)],
                                       stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the worker and its compile workers
                process.wait()
                return {"status": "timeout", "reason": f"no result after {timeout_s:.0f} s; see {log_path}"}
        if result_path.is_file():
            return json.loads(result_path.read_text())
        return {"status": "error", "reason": f"worker exited with status {returncode}; see {log_path}"}


def run_cell(spec: dict, options: SweepOptions, env: dict, round_index: int) -> dict:
    if spec["kind"] == "anchor":
        reason = unavailable_reason(spec["anchor"], spec["batch_size"], spec["model"])
        if reason:
            return {"status": "unavailable", "reason": reason}
    name = spec["name"].replace(" ", "_").replace("=", "") + (f"_round{round_index + 1}" if round_index else "")
    return run_worker(spec, options.out / "logs" / f"{name}.log", env, options.cell_timeout_s)


def fastest_round(results: list[dict]) -> dict:
    """The round with the most tokens/s, with every round's tokens/s and the first round's start-up (the cold one
    when the cache lacked the cell's graphs); a cell that never succeeded keeps its first failure."""
    ok = [result for result in results if result["status"] == "ok"]
    if not ok:
        return results[0]
    best = dict(max(ok, key=lambda result: result["tokens_per_s"]))
    if len(results) > 1:
        best["rounds_tokens_per_s"] = [result.get("tokens_per_s") for result in results]
        first = results[0]
        best["first_round"] = {key: first[key] for key in ("warmup_s", "packages_compiled", "packages_loaded",
                                                           "compile_processes") if key in first}
    return best


def worker_env(options: SweepOptions, cache_dir: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    if options.threads:
        env["OMP_NUM_THREADS"] = str(options.threads)
    return env


def cell_record(spec: dict, result: dict) -> dict:
    keys = ("kind", "name", "anchor", "graph_mode", "num_speculative_tokens", "batch_size", "draft_tree", "drafter")
    return {**{key: spec[key] for key in keys if key in spec}, **result}


def compare(records: list[dict], bandwidth_gb_s: float | None = None) -> None:
    """Adds to every engine record: tokens/s as a ratio to each anchor at the same batch size, whether its
    acceptance equals the eager cell's (same k and batch), and how many outputs equal transformers' greedy ones;
    with the measured read bandwidth, also the ratio to the plain-decoding limit (benchmarks/bandwidth.py)."""
    ok = [r for r in records if r["status"] == "ok"]
    anchors = {(r["anchor"], r["batch_size"]): r for r in ok if r["kind"] == "anchor"}
    eager = {(r["num_speculative_tokens"], r["batch_size"], r.get("draft_vocab_size"), shape(r)): r for r in ok
             if r["kind"] == "engine" and r["graph_mode"] == "eager"}
    reference = anchors.get(("hf-eager", 1)) or next((r for (name, _), r in anchors.items() if name == "hf-eager"), None)
    for record in ok:
        if record["kind"] != "engine":
            continue
        record["speedup_vs"] = {
            name: (record["tokens_per_s"] / anchors[name, record["batch_size"]]["tokens_per_s"]
                   if (name, record["batch_size"]) in anchors else None)
            for name in ANCHORS
        }
        if bandwidth_gb_s and record.get("main_weight_bytes"):
            limit = record["batch_size"] * bandwidth_gb_s * 1e9 / record["main_weight_bytes"]
            record["plain_decoding_limit_tokens_per_s"] = limit
            record["speedup_vs"]["plain-limit"] = record["tokens_per_s"] / limit
        base = eager.get((record["num_speculative_tokens"], record["batch_size"], record.get("draft_vocab_size"),
                          shape(record)))
        if record["num_speculative_tokens"] == "auto":
            base = None  # auto chooses by measured step times, which differ between modes
            compare_with_fixed_k(record, ok)
        if base is not None and base is not record:
            record["acceptance_equals_eager"] = base["accepted_per_position"] == record["accepted_per_position"]
            record["accepted_differs_from_eager_by"] = sum(
                abs(a - b) for a, b in zip(base["accepted_per_position"], record["accepted_per_position"])
            )
        if reference is not None:
            record["outputs_equal_to_hf_eager"] = sum(
                a == b for a, b in zip(record["output_digests"], reference["output_digests"])
            )


def shape(record: dict) -> tuple | None:
    """A cell's token tree as a tuple, None for chains (JSON gives lists)."""
    return tuple(record["draft_tree"]) if record.get("draft_tree") else None


def compare_with_fixed_k(auto: dict, records: list[dict]) -> None:
    """auto's tokens/s over the best fixed k's in the same mode and batch size (and draft vocabulary; k=0 has
    none, it is the same plain decoding for every size); auto with a tree chooses among chains and that tree, so its
    best fixed cell may be either."""
    fixed = [r for r in records if r["kind"] == "engine" and isinstance(r["num_speculative_tokens"], int)
             and r["graph_mode"] == auto["graph_mode"] and r["batch_size"] == auto["batch_size"]
             and (r["num_speculative_tokens"] == 0 or r.get("draft_vocab_size") == auto.get("draft_vocab_size"))
             and shape(r) in (None, shape(auto))]
    if not fixed:
        return
    best = max(fixed, key=lambda r: r["tokens_per_s"])
    auto["best_fixed_k"] = best["num_speculative_tokens"]
    auto["best_fixed_k_tokens_per_s"] = best["tokens_per_s"]
    auto["auto_over_best_fixed_k"] = auto["tokens_per_s"] / best["tokens_per_s"]


def run_sweep(options: SweepOptions) -> dict:
    """Runs every cell and writes the outputs; a ValueError names bad input found before any cell ran."""
    if not (options.model / "config.json").is_file() and not is_gguf(options.model):
        raise ValueError(f"{options.model} has no config.json; pass a checkpoint directory or a .gguf file with --model")
    prompt_ids = prompt_token_ids(options.model, options.prompts)
    max_seq_len = options.max_seq_len or auto_max_seq_len(prompt_ids, options.max_tokens)
    cells = plan(options, prompt_ids, max_seq_len)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "logs").mkdir(exist_ok=True)
    owned_cache = options.cache_dir is None
    cache_dir = Path(tempfile.mkdtemp(prefix="bench-inductor-")) if owned_cache else options.cache_dir
    cache_was_empty = not cache_dir.exists() or not any(cache_dir.iterdir())
    env = worker_env(options, cache_dir)
    results = {
        "command": shlex.join(options.command),
        "environment": {**environment.describe(),
                        "read_bandwidth_readings_gb_s": {"start": measure_in_subprocess(options.threads)}},
        "settings": {
            "model": str(options.model),
            "prompts": len(prompt_ids),
            "prompt_lengths": [len(ids) for ids in prompt_ids],
            "max_tokens": options.max_tokens,
            "max_seq_len": max_seq_len,
            "buckets": options.buckets,
            "repeats": options.repeats,
            "rounds": options.rounds,
            "sampling": "greedy, ignore_eos (every request generates max_tokens)",
            "hisparse": options.hisparse,
            "inductor_cache": {"dir": None if owned_cache else str(cache_dir), "empty_at_start": cache_was_empty},
        },
        "records": [],
    }
    rounds: list[list[dict]] = [[] for _ in cells]
    bar = tqdm(total=len(cells) * options.rounds, desc="bench", unit="cell", file=sys.stderr)
    try:
        for round_index in range(options.rounds):
            for spec, cell_rounds in zip(cells, rounds):
                bar.set_postfix_str(spec["name"] + (f" (round {round_index + 1})" if options.rounds > 1 else ""))
                cell_rounds.append(run_cell(spec, options, env, round_index))
                bar.update()
    finally:
        bar.close()
        if owned_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    results["records"] = [cell_record(spec, fastest_round(cell_rounds)) for spec, cell_rounds in zip(cells, rounds)]
    results["environment"]["load_average_at_end"] = list(os.getloadavg())
    readings = results["environment"]["read_bandwidth_readings_gb_s"]
    readings["end"] = measure_in_subprocess(options.threads)
    results["environment"]["read_bandwidth_gb_s"] = limit_bandwidth(readings)
    compare(results["records"], results["environment"]["read_bandwidth_gb_s"])
    results["environment"]["plain_cells_over_limit"] = plain_cells_over_limit(results["records"])
    write_outputs(results, options)
    return results


def write_outputs(results: dict, options: SweepOptions) -> None:
    (options.out / "results.json").write_text(json.dumps(results, indent=2))
    plots = []
    if options.plots:
        plots = report.plot_tokens_per_s(results, options.out / "tokens_per_s.png")
        plots += report.plot_acceptance(results, options.out / "acceptance.png")
    (options.out / "results.md").write_text(report.markdown(results, [path.name for path in plots]))
