"""What a change must leave as it was: for each model, the digest of every token decoded, the accepted drafts per
position, and the step time's median, greedy in one graph mode. Uses only the public API and Engine.step_seconds, so
the same file runs against an older checkout (PYTHONPATH=OLD python -m compiled_spec.benchmarks.behaviour ...) and the
two JSON files compare side by side.

    python -m compiled_spec.benchmarks.behaviour --models default,smollm2-135m --graph-mode full --out after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = {
    "default": ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "KING HENRY:\nOnce more unto the breach", "First Citizen:"],
    "smollm2-135m": ["def fibonacci(n):", "The history of the printing press begins",
                     "Write a haiku about the sea.", "import json\n\ndef load(path):"],
}


def measure(model: str, graph_mode: str, max_tokens: int, rounds: int) -> dict:
    from compiled_spec import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(None if model == "default" else model, graph_mode=graph_mode, show_progress=False)
    ready = time.perf_counter() - start
    prompts = PROMPTS[model]
    digest, accepted, steps = hashlib.sha256(), None, []
    for round_index in range(rounds):
        llm.engine.step_seconds.clear()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        steps += llm.engine.step_seconds
        if round_index == 0:
            for output in outputs:
                digest.update(json.dumps(output.token_ids).encode())
            accepted = [sum(column) for column in zip(*(o.stats.accepted_per_position for o in outputs))]
    return {"model": model, "graph_mode": graph_mode, "k": llm.num_speculative_tokens, "prompts": len(prompts),
            "max_tokens": max_tokens, "tokens_sha256": digest.hexdigest(), "accepted_per_position": accepted,
            "steps": len(steps), "step_p50_ms": round(1000 * statistics.median(steps), 3), "ready_s": round(ready, 1)}


def git_commit() -> str:
    import compiled_spec

    root = Path(compiled_spec.__file__).resolve().parents[1]
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default,smollm2-135m",
                        help=f"comma-separated, of: {', '.join(PROMPTS)}")
    parser.add_argument("--graph-mode", default="full")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="decodes of the prompts; the first gives the digest")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [model for model in models if model not in PROMPTS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(PROMPTS)}")
    records = [measure(model, args.graph_mode, args.max_tokens, args.rounds) for model in models]
    args.out.write_text(json.dumps({"commit": git_commit(), "records": records}, indent=1) + "\n")
    for record in records:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
