"""What the graph canary costs: decode steps with and without its check, and the rate that keeps it under 2%.

    python -m compiled_spec.benchmarks.canary_cost [--graph-mode compile] [--batch-size 8] [-k 3] [--every 4] [--max-tokens 96]
                                     [--out canary_cost_out]

One engine (the default model) decodes --batch-size requests with verify_graphs_every=--every; the steps the canary
checked and the ones it did not are timed apart (Engine.step_seconds, the host copy included). A checked step costs
its compiled step plus a copy of the decode state, the eager step on it and the comparison, so at a rate of one check
in N steps the throughput lost is extra / (N x step): printed for N = 64, 128, 256, 512, with the smallest power of
two under 2%. Writes canary_cost.json under --out. A measurement, not a test: numbers depend on the machine and its
load.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from compiled_spec import LLM, SamplingParams

BUDGET = 0.02


def overhead(extra_s: float, step_s: float, every: int) -> float:
    """Fraction of decode throughput lost when one step in `every` is checked."""
    return extra_s / (every * step_s + extra_s)


def smallest_rate(extra_s: float, step_s: float, budget: float = BUDGET) -> int:
    every = 1
    while overhead(extra_s, step_s, every) > budget:
        every *= 2
    return every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph-mode", default="compile")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("canary_cost_out"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(graph_mode=args.graph_mode, num_speculative_tokens=args.k, max_batch_size=args.batch_size,
              batch_buckets=(args.batch_size,), prefill_buckets=(16,), max_seq_len=args.max_tokens + 32,
              verify_graphs_every=args.every, show_progress=False)
    prompts = [[5 + i, 9, 17, 3, 11, 2, 8, 4] for i in range(args.batch_size)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # first calls
    engine = llm.engine
    engine.step_seconds.clear()
    first = engine.steps_run + 1
    llm.generate(prompts, params)
    checked, plain = [], []
    for number, seconds in enumerate(engine.step_seconds, start=first):
        (checked if number in engine.canary.checked_steps else plain).append(seconds)
    step, checked_step = statistics.median(plain), statistics.median(checked)
    extra = checked_step - step
    result = {
        "graph_mode": engine.runner.mode.value, "batch_size": args.batch_size, "k": args.k,
        "steps_plain": len(plain), "steps_checked": len(checked), "divergences": len(engine.canary.divergences),
        "step_ms": step * 1e3, "checked_step_ms": checked_step * 1e3, "extra_per_check_ms": extra * 1e3,
        "overhead_at": {str(n): overhead(extra, step, n) for n in (64, 128, 256, 512)},
        "smallest_power_of_two_under_2_percent": smallest_rate(extra, step),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "canary_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['graph_mode']}, batch {args.batch_size}, k={args.k}: step {result['step_ms']:.1f} ms, checked "
          f"step {result['checked_step_ms']:.1f} ms (+{result['extra_per_check_ms']:.1f} ms per check; "
          f"{len(checked)} checked, {len(plain)} not, {result['divergences']} divergences)")
    for n, lost in result["overhead_at"].items():
        print(f"  one check in {n:>3} steps: {100 * lost:.2f}% of decode throughput")
    print(f"  under 2% from one check in {result['smallest_power_of_two_under_2_percent']} steps")


if __name__ == "__main__":
    main()
