"""What a JSON schema costs decoding: SmolLM2-135M (Q4_1 packed, its shipped MTP modules), the twenty schema prompts of
prompts/json_schemas.json through its chat template, greedy at batch 1, graph_mode "compile", at one k.

Rows: an engine without structured output (its steps hold no masks) and one with it, each on the prompts alone; then
the second with each prompt's schema. The schema changes the text, so the comparison that decides is tokens/s with
the schema against tokens/s without it on the same engine and k, with each run's acceptance beside it: end to end,
and over the decode steps alone (a schema's answers are shorter, so their prompts' prefills weigh more end to end).
The host's part (the grammar walk over each step's drafts and the emitted tokens, engine/structured_output.py) is
timed on its own. Runs taken in turn; best of --repeats per row.

    python -m compiled_spec.benchmarks.structured_output_cost [-k 2] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.engine.engine import Engine
from compiled_spec.engine.structured_output import Constraint
from .environment import save_run

SCHEMAS = Path(__file__).with_name("prompts") / "json_schemas.json"


class HostTimer:
    """Seconds spent in the grammar walk before each step and in advancing the matchers after it."""

    def __init__(self):
        self.seconds = 0.0
        self.steps = 0

    def wrap(self, function, counts_steps: bool):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.steps += counts_steps
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write structured_output_cost.json and table.md here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = json.loads(SCHEMAS.read_text())
    engines = {on: LLM("smollm2-135m", num_speculative_tokens=args.k, graph_mode="compile", max_batch_size=1,
                       max_seq_len=512, structured_output=on, show_progress=False) for on in (False, True)}
    conversations = [[{"role": "user", "content": case["prompt"]}] for case in cases]
    runs = {"no masks, no schema": (engines[False], False), "masks, no schema": (engines[True], False),
            "masks, the prompt's schema": (engines[True], True)}
    timer = HostTimer()
    Engine._write_token_masks = timer.wrap(Engine._write_token_masks, counts_steps=True)
    Constraint.accept = timer.wrap(Constraint.accept, counts_steps=False)
    best = {name: {"tokens_per_second": 0.0} for name in runs}
    for repeat in range(args.repeats + 1):  # the first round warms up (and compiles)
        for name, (llm, constrained) in runs.items():
            timer.seconds, timer.steps = 0.0, 0
            first_step = len(llm.engine.step_seconds)
            start = time.perf_counter()
            outputs = []
            for case, conversation in zip(cases, conversations):
                params = SamplingParams(max_tokens=args.max_tokens, json_schema=case["schema"] if constrained else None)
                outputs += llm.chat(conversation, params)
            seconds = time.perf_counter() - start
            step_seconds = sum(llm.engine.step_seconds[first_step:])
            tokens = sum(len(o.token_ids) for o in outputs)
            steps = sum(o.stats.steps for o in outputs)
            accepted = sum(o.stats.accepted for o in outputs)
            if repeat and tokens / seconds > best[name]["tokens_per_second"]:
                best[name] = {"tokens_per_second": tokens / seconds, "tokens": tokens,
                              # the steps alone: each request's first token comes from its prefill
                              "decode_tokens_per_second": (tokens - len(outputs)) / step_seconds,
                              "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
                              "acceptance": accepted / (steps * args.k) if steps and args.k else 0.0,
                              "host_us_per_step": 1e6 * timer.seconds / timer.steps if timer.steps else 0.0,
                              "host_share": timer.seconds / seconds}
    base = best["masks, no schema"]
    lines = [f"| k={args.k} | tokens/s | vs masks, no schema | decode tokens/s | vs masks, no schema | tokens | "
             "acceptance | mean accepted length | host µs/step (share) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in best.items():
        host = f"{row['host_us_per_step']:.0f} ({100 * row['host_share']:.1f}%)" if row["host_us_per_step"] else "-"
        lines.append(f"| {name} | {row['tokens_per_second']:.1f} | "
                     f"{row['tokens_per_second'] / base['tokens_per_second']:.3f}x | "
                     f"{row['decode_tokens_per_second']:.1f} | "
                     f"{row['decode_tokens_per_second'] / base['decode_tokens_per_second']:.3f}x | {row['tokens']} | "
                     f"{row['acceptance']:.3f} | {row['mean_accepted_length']:.2f} | {host} |")
    save_run(args.out, "structured_output_cost", {"runs": best, "args": vars(args) | {"out": str(args.out)}},
             "\n".join(lines))


if __name__ == "__main__":
    main()
