"""Evaluate a checkpoint on held-out plays.

Reports validation cross-entropy of the main model, top-1 accuracy of each MTP depth under teacher
forcing (and how often it agrees with the main model's greedy token), and greedy speculative
acceptance per draft position with the mean accepted length for k = 1, 2, 3, all through the engine.

    python -m compiled_spec.training.evaluate --model compiled_spec/default_model --json eval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from compiled_spec import LLM, SamplingParams, SpecStats
from compiled_spec.api import DEFAULT_MODEL
from compiled_spec.training.corpus import fetch_texts_dir, read_works

CONFIG = Path(__file__).parent / "train_config.json"


def held_out_ids(tokenizer, config: dict) -> list[int]:
    works = read_works(fetch_texts_dir(Path(config["work_dir"])))
    text = "".join(works[name] for name in config["corpus"]["validation_works"])
    return tokenizer.encode(text, add_special_tokens=False)


def evenly_spaced_windows(ids: list[int], count: int, length: int) -> list[list[int]]:
    stride = max(1, (len(ids) - length) // count)
    return [ids[start : start + length] for start in range(0, stride * count, stride)][:count]


def teacher_forced_metrics(llm: LLM, windows: list[list[int]]) -> dict:
    depths = llm.model_config.num_mtp_modules
    loss, tokens = 0.0, 0
    correct = [0] * depths
    agree = [0] * depths
    rows = [0] * depths
    for ids in windows:
        target = torch.tensor(ids)
        main = llm.logits(ids)
        loss += F.cross_entropy(main[:-1], target[1:], reduction="sum").item()
        tokens += len(ids) - 1
        main_greedy = main.argmax(-1)
        for depth in range(1, depths + 1):
            predicted = llm.mtp_logits(ids, depth=depth).argmax(-1)[:-1]  # the last row has no target
            correct[depth - 1] += (predicted == target[depth + 1 :]).sum().item()
            agree[depth - 1] += (predicted == main_greedy[depth:-1]).sum().item()
            rows[depth - 1] += predicted.numel()
    return {
        "validation_cross_entropy": loss / tokens,
        "mtp_top1_accuracy": [c / r for c, r in zip(correct, rows)],
        "mtp_top1_agreement_with_main": [a / r for a, r in zip(agree, rows)],
        "tokens": tokens,
    }


def generate_with_stats(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list, SpecStats]:
    """The outputs for `prompts` and their speculation statistics summed over all of them."""
    outputs = llm.generate(prompts, params)
    total = SpecStats(llm.num_speculative_tokens)
    for output in outputs:
        total.merge(output.stats)
    return outputs, total


def acceptance(model: Path, prompts: list[list[int]], k: int, max_tokens: int, graph_mode: str, max_seq_len: int = 512) -> dict:
    llm = LLM(model, num_speculative_tokens=k, graph_mode=graph_mode, max_batch_size=8, max_seq_len=max_seq_len,
              show_progress=False)
    _, total = generate_with_stats(llm, prompts, SamplingParams(max_tokens=max_tokens))
    return {
        "k": k,
        "steps": total.steps,
        "acceptance_rate_per_position": total.acceptance_rate_per_position,
        "mean_accepted_length": total.mean_accepted_length,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--config", type=Path, default=CONFIG, help="training config naming the held-out plays")
    parser.add_argument("--windows", type=int, default=32, help="teacher-forcing windows")
    parser.add_argument("--window-length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts for speculative decoding")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--graph-mode", default="eager")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)

    config = json.loads(args.config.read_text())
    llm = LLM(args.model, num_speculative_tokens=0, graph_mode="eager", max_seq_len=args.window_length + 1,
              show_progress=False)
    ids = held_out_ids(llm.tokenizer, config)
    results = {"model": str(args.model), "held_out": config["corpus"]["validation_works"]}
    results.update(teacher_forced_metrics(llm, evenly_spaced_windows(ids, args.windows, args.window_length)))
    prompts = evenly_spaced_windows(ids, args.prompts, args.prompt_length)
    results["speculative"] = [acceptance(args.model, prompts, k, args.max_tokens, args.graph_mode) for k in (1, 2, 3)]

    print(f"validation cross-entropy: {results['validation_cross_entropy']:.3f} nats/token over {results['tokens']} tokens")
    for depth, (accuracy, agreement) in enumerate(
        zip(results["mtp_top1_accuracy"], results["mtp_top1_agreement_with_main"]), start=1
    ):
        print(f"MTP depth {depth}: top-1 accuracy {accuracy:.1%}, agrees with the main model's greedy token {agreement:.1%}")
    for row in results["speculative"]:
        rates = " ".join(f"{rate:.1%}" for rate in row["acceptance_rate_per_position"])
        print(f"greedy k={row['k']}: acceptance by draft position {rates} | mean accepted length "
              f"{row['mean_accepted_length']:.2f} tokens/step over {row['steps']} steps")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
