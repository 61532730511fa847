"""Greedy speculative acceptance of trained MTP modules on held-out prompts, per domain, through the engine.

    python -m compiled_spec.training.mtp_acceptance --mtp compiled_spec/mtp_modules/smollm2-135m \\
        [-k 2,3] [--draft-tree 2,2,1 ...] [--draft-vocab 4096,8192,16384,49152] [--draft-dtype float16] \\
        [--json evaluation.json]

Each chain (-k) and token tree (--draft-tree) is measured per domain and on all domains together ("mixed": tokens
per step over every step of the three). An existing --json file measured with the same settings (model, modules,
prompts, tokens, draft dtype) gains this run's shapes; a shape it had is replaced.

The prompts come from the parts of each domain that training never sees (mtp_corpus): openings of held-out
standard-library functions, passages of held-out plays, and held-out chat prompts in the chat template.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..api import LLM
from ..chat import chat_prompt
from ..loading.checkpoint import MTP_CONFIG_NAME
from ..model.half_weight_linear import draft_weight_dtype
from ..params import SamplingParams
from .evaluate import generate_with_stats
from .mtp_corpus import DEF_LINE, chat_prompts, held_out_code_files, prose_texts


def held_out_prompts(config: dict, tokenizer, per_domain: int) -> dict[str, list[str]]:
    corpus = config["corpus"]
    prompts = {}
    if "code" in corpus["domains"]:
        # In each of per_domain held-out modules (training never reads any of them), the source up to and
        # including its first `def` line: the model writes the body.
        openings = []
        for path in held_out_code_files(corpus["code_held_out_percent"]):
            text = path.read_text(encoding="utf-8", errors="replace")
            match = DEF_LINE.search(text, len(text) // 3)
            if match:
                openings.append(text[max(0, match.end() - 600): match.end()])
        prompts["code"] = openings[:: max(1, len(openings) // per_domain)][:per_domain]
    if "prose" in corpus["domains"]:
        _, held_out = prose_texts(Path(config["work_dir"]), corpus["prose_held_out_works"], corpus["prose_chars"])
        text = "".join(held_out)
        stride = len(text) // (per_domain + 1)
        prompts["prose"] = [text[stride * (i + 1): stride * (i + 1) + 400] for i in range(per_domain)]
    if "chat" in corpus["domains"]:
        questions = chat_prompts(held_out=True)
        questions = questions[:: max(1, len(questions) // per_domain)][:per_domain]
        prompts["chat"] = [chat_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    return prompts


def acceptance(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    outputs, total = generate_with_stats(llm, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return {"steps": total.steps, "acceptance_rate_per_position": total.acceptance_rate_per_position,
            "mean_accepted_length": total.mean_accepted_length,
            "token_ids": [output.token_ids for output in outputs]}


def summary(row: dict) -> str:
    rates = " ".join(f"{rate:.1%}" for rate in row["acceptance_rate_per_position"])
    return (f"acceptance by position {rates} | tokens per step {row['mean_accepted_length']:.2f} | "
            f"output = k=0: {row['equals_k0']}")


def mixed(rows: list[dict]) -> dict:
    """The domains together: tokens per step over all their steps, acceptance per position weighted by steps."""
    steps = sum(row["steps"] for row in rows)
    width = len(rows[0]["acceptance_rate_per_position"])
    return {"steps": steps,
            "acceptance_rate_per_position": [sum(row["acceptance_rate_per_position"][i] * row["steps"] for row in rows)
                                             / steps for i in range(width)],
            "mean_accepted_length": sum(row["mean_accepted_length"] * row["steps"] for row in rows) / steps,
            "equals_k0": all(row["equals_k0"] for row in rows)}


SETTINGS = ("model", "mtp", "max_tokens", "prompts_per_domain", "greedy", "draft_dtype")


def merged(earlier: dict, results: dict) -> dict:
    """results added to an earlier file's: per draft vocabulary, this run's shapes replace or join the earlier ones.
    Raises ValueError naming the settings that differ (the two runs' figures would not be comparable)."""
    differ = [f"{name}: {earlier.get(name)!r} there, {results.get(name)!r} here" for name in SETTINGS
              if earlier.get(name) != results.get(name)]
    if differ:
        raise ValueError("was measured with other settings (" + "; ".join(differ) + "); give another --json file")
    combined = {**earlier, "by_draft_vocab_size": {size: dict(shapes) for size, shapes in
                                                   earlier["by_draft_vocab_size"].items()}}
    for size, shapes in results["by_draft_vocab_size"].items():
        combined["by_draft_vocab_size"].setdefault(size, {}).update(shapes)
    return combined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mtp", type=Path, required=True, help="a directory train-mtp wrote")
    parser.add_argument("--model", default=None, help="the base model (default: the one the modules were trained on)")
    parser.add_argument("-k", default="3", help="comma-separated chain lengths [default: 3]")
    parser.add_argument("--draft-tree", action="append", default=[], metavar="W1,W2,...",
                        help="a token tree to measure too (repeatable), as generate --draft-tree takes it")
    parser.add_argument("--draft-vocab", default=None, help="comma-separated sizes (default: the trained size)")
    parser.add_argument("--draft-dtype", default=None,
                        help="the drafts' weight dtype, float16 or float32 (default: LLM's, float16 for smollm2-135m)")
    parser.add_argument("--prompts", type=int, default=32,
                        help="held-out prompts per domain (8 were too few to rank two trained module sets)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--graph-mode", default="eager",
                        help="acceptance is the same in every mode; eager starts at once (full compiles first)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = json.loads((args.mtp / MTP_CONFIG_NAME).read_text())
    model = args.model or config["model"]
    sizes = [int(s) for s in args.draft_vocab.split(",")] if args.draft_vocab else [None]
    plain = LLM(model, num_speculative_tokens=0, graph_mode=args.graph_mode, max_batch_size=8, max_seq_len=768,
                show_progress=False)
    prompts = held_out_prompts(config, plain.tokenizer, args.prompts)
    reference = {domain: acceptance(plain, texts, args.max_tokens)["token_ids"] for domain, texts in prompts.items()}
    shapes = [(f"chain k={k}", dict(num_speculative_tokens=int(k))) for k in args.k.split(",")]
    shapes += [(f"tree {tree}", dict(draft_tree=tree)) for tree in args.draft_tree]
    results = {"model": str(model), "mtp": str(args.mtp), "max_tokens": args.max_tokens,
               "prompts_per_domain": args.prompts, "greedy": True, "by_draft_vocab_size": {}}
    for size in sizes:
        label = str(size or config["draft_vocab_size"])
        results["by_draft_vocab_size"][label] = by_shape = {}
        for name, shape in shapes:
            llm = LLM(model, mtp=args.mtp, draft_vocab_size=size, draft_dtype=args.draft_dtype,
                      graph_mode=args.graph_mode, max_batch_size=8, max_seq_len=768, show_progress=False, **shape)
            results["draft_dtype"] = draft_weight_dtype(llm.model)
            rows = by_shape[name] = {}
            for domain, texts in prompts.items():
                row = acceptance(llm, texts, args.max_tokens)
                row["equals_k0"] = row.pop("token_ids") == reference[domain]
                rows[domain] = row
                print(f"draft vocab {label:>6} {name:>12} {domain:>5}: " + summary(row), flush=True)
            rows["mixed"] = mixed(list(rows.values()))
            print(f"draft vocab {label:>6} {name:>12} mixed: " + summary(rows["mixed"]), flush=True)
    if args.json:
        if args.json.exists():
            try:
                results = merged(json.loads(args.json.read_text()), results)
            except ValueError as error:
                fallback = args.json.with_suffix(".new.json")
                fallback.write_text(json.dumps(results, indent=2) + "\n")
                parser.exit(2, f"error: {args.json} {error}; this run's results are in {fallback}\n")
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
