"""compiled-spec bench on several torch releases, in one table: the same cells (full, batch 1, k=0 and the model's
default k) for the default model and SmolLM2-135M, each torch in an environment of its own (a Python with that torch
and compiled-spec installed), run in turn, each torch with a cold inductor cache of its own. Each row says which
changes to torch (compiler/torch_patches.py) its cells ran with, and whether its tokens equal the first torch's.

    python -m compiled_spec.benchmarks.torch_versions --python /venv-2.13/bin/python --python /venv-2.15/bin/python \\
        --out benchmarks/results/torch-versions
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from .environment import save_run
from .report import acceptance_text, engine_records, number, patches_summary

PROMPTS = Path(__file__).with_name("prompts")
# (label, bench's model options, k values: 0 and the model's default)
MODELS = (
    ("default model", [], "0,3"),
    ("SmolLM2-135M Q4_1", ["--model", "smollm2-135m", "--prompts-file", str(PROMPTS / "smollm2_held_out.json")], "0,2"),
)


def torch_of(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                          check=True).stdout.strip()


def bench(python: str, model_options: list[str], ks: str, out: Path, cache: Path, threads: int, repeats: int) -> dict:
    command = [python, "-m", "compiled_spec.cli", "bench", *model_options, "--graph-modes", "full", "-k", ks,
               "--batch-sizes", "1", "--anchors", "none", "--threads", str(threads), "--max-tokens", "64",
               "--buckets", "workload", "--repeats", str(repeats), "--cache-dir", str(cache), "--out", str(out)]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads((out / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True,
                        help="a Python whose environment has the torch to measure and compiled-spec (repeatable)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell; the best is kept")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    caches = Path(tempfile.mkdtemp(prefix="torch-versions-"))  # cold, and not among the results
    rows, record = [], {"runs": []}
    first_digests: dict[tuple[str, int], list[str]] = {}
    for python in args.python:
        version = torch_of(python)
        for label, model_options, ks in MODELS:
            out = args.out / f"torch-{version.replace('+', '-')}" / label.split()[0].lower()
            results = bench(python, model_options, ks, out, caches / version, args.threads,
                            args.repeats)
            record["runs"].append({"torch": version, "model": label, "command": results["command"],
                                   "results": str(out.relative_to(args.out) / "results.json")})
            for cell in engine_records(results):
                if cell["status"] != "ok":
                    rows.append(f"| {label} | {version} | {cell['num_speculative_tokens']} | {cell['status']} |"
                                + " |" * 5)
                    continue
                key = (label, cell["num_speculative_tokens"])
                same = first_digests.setdefault(key, cell["output_digests"]) == cell["output_digests"]
                rows.append(" | ".join([
                    f"| {label}", version, str(cell["num_speculative_tokens"]), number(cell["tokens_per_s"]),
                    f"{cell['step_latency_ms']['p50']:.2f}", acceptance_text(cell),
                    number(cell["warmup_s"]), "yes" if same else "no",
                    patches_summary([cell]),
                ]) + " |")
    table = "\n".join([
        "| model | torch | k | tokens/s | step p50 ms | acceptance by position | warm-up s (cold compile) "
        "| tokens = first torch's | torch patches |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    save_run(args.out, "torch_versions", record, table)


if __name__ == "__main__":
    main()
