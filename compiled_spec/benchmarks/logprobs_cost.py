"""What logprobs cost a decode step: SmolLM2-135M (Q4_1 packed, its shipped MTP modules, k=2), one engine with
max_logprobs=0 (steps compute none) and one with serve's default of 20, each decoding the held-out prompts greedily
at batch 1; the second also with every request asking logprobs=5 (the host then reads them back too). graph_mode
"compile" (two compiles, not full's packages: the ops logprobs add are the same). Runs taken in turn, so a slow
moment lands on all of them; best of --repeats per configuration.

    python -m compiled_spec.benchmarks.logprobs_cost [--threads 2] [--max-tokens 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from compiled_spec import LLM, SamplingParams
from .environment import save_run

PROMPTS = Path(__file__).with_name("prompts") / "smollm2_held_out.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4, help="the first N held-out prompts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write logprobs_cost.json and table.md here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = json.loads(PROMPTS.read_text())[: args.prompts]
    engines = {n: LLM("smollm2-135m", num_speculative_tokens=2, graph_mode="compile", max_batch_size=1,
                      max_seq_len=512, max_logprobs=n, show_progress=False) for n in (0, 20)}
    runs = {"max_logprobs=0": (engines[0], None), "max_logprobs=20, none asked": (engines[20], None),
            "max_logprobs=20, logprobs=5 asked": (engines[20], 5)}
    best = dict.fromkeys(runs, 0.0)
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, (llm, logprobs) in runs.items():
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=logprobs)
            start = time.perf_counter()
            outputs = [llm.generate(prompt, params)[0] for prompt in prompts]
            rate = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
            if repeat:
                best[name] = max(best[name], rate)
    base = best["max_logprobs=0"]
    lines = ["| engine | tokens/s | vs max_logprobs=0 |", "|---|---|---|"]
    lines += [f"| {name} | {rate:.1f} | {rate / base:.3f}x |" for name, rate in best.items()]
    save_run(args.out, "logprobs_cost", {"tokens_per_second": best, "args": vars(args) | {"out": str(args.out)}},
             "\n".join(lines))


if __name__ == "__main__":
    main()
