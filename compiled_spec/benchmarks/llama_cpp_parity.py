"""Greedy text against llama.cpp on the same GGUF file: where the two engines part, prompt by prompt.

    python -m compiled_spec.benchmarks.llama_cpp_parity --model smollm2-135m --out benchmarks/results/llama-cpp-parity

Both engines decode the held-out prompts (benchmarks/prompts/smollm2_held_out.json) greedily from the same token ids,
EOS ignored. They round differently (llama.cpp quantizes activations to 8 bits for its integer dot products; this
engine widens the weights to float32), so their texts may part at a near tie and then go their own ways: the report
gives each prompt's first differing position (none: equal for all --max-tokens tokens), not a pass or fail. Needs
llama-cpp-python (not a dependency: pip install llama-cpp-python builds it from source). Writes OUT/parity.json and
OUT/parity.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

from .environment import describe
from .llama_cpp_anchor import greedy_tokens

HELD_OUT = Path(__file__).with_name("prompts") / "smollm2_held_out.json"


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((index for index, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def llama_cpp_greedy(path: Path, prompts: list[list[int]], max_tokens: int, threads: int) -> list[list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=max(map(len, prompts)) + max_tokens + 8, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    return [greedy_tokens(llm, prompt, max_tokens) for prompt in prompts]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="A .gguf file or a model name (default: smollm2-135m).")
    parser.add_argument("--prompts", default=str(HELD_OUT), help="A JSON list of prompt strings.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Greedy tokens per prompt.")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads.")
    parser.add_argument("--out", default="bench_out/llama-cpp-parity")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit("llama-cpp-python is not installed (pip install llama-cpp-python builds it from source)")
    from .. import LLM, SamplingParams
    from ..loading.registry import model_path

    path = Path(args.model) if args.model.endswith(".gguf") else model_path(args.model)
    if path.suffix != ".gguf" or not path.is_file():
        sys.exit(f"--model {args.model}: llama.cpp needs a .gguf file; {path} is not one (fetch a named model first)")
    texts = json.loads(Path(args.prompts).read_text())
    ours_llm = LLM(str(path), graph_mode="eager", max_batch_size=4, max_seq_len=1024, show_progress=False)
    prompts = [ours_llm.encode(text) for text in texts]
    ours = [output.token_ids for output in ours_llm.generate(
        prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))]
    theirs = llama_cpp_greedy(path, prompts, args.max_tokens, args.threads)
    parted = [first_difference(a, b) for a, b in zip(ours, theirs)]
    results = {
        "command": ["python", "-m", "compiled_spec.benchmarks.llama_cpp_parity",
                    *(argv if argv is not None else sys.argv[1:])],
        "machine": describe(), "model": str(path), "max_tokens": args.max_tokens,
        "prompts": [{"prompt_tokens": len(p), "first_difference": d, "ours": a, "llama_cpp": b}
                    for p, d, a, b in zip(prompts, parted, ours, theirs)],
        "equal_throughout": sum(d is None for d in parted),
        "median_first_difference": statistics.median(
            args.max_tokens if d is None else d for d in parted) if parted else None,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(results, indent=1))
    lines = ["| prompt | prompt tokens | first differing token (of %d) |" % args.max_tokens, "|---|---|---|"]
    lines += [f"| {i + 1} | {len(p)} | {'none' if d is None else d} |" for i, (p, d) in enumerate(zip(prompts, parted))]
    lines += ["", f"{results['equal_throughout']} of {len(parted)} prompts equal for all {args.max_tokens} tokens; "
                  f"median first difference {results['median_first_difference']} (a prompt equal throughout counts as "
                  f"{args.max_tokens})"]
    (out / "parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
