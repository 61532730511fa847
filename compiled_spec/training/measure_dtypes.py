"""Times one generation batch and a few training steps of train-mtp in float32 and in bfloat16 on this machine,
and how often bfloat16 generation picks the tokens float32 does (along its own continuation, and on float32's
text).

    python -m compiled_spec.training.measure_dtypes [--model smollm2-135m] [--prompts 64] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from ..loading.registry import resolve_model
from ..loading.tokenizer import load_tokenizer
from .mtp_corpus import chat_prompts, code_texts, line_prompts
from .self_generated import continue_batch
from .train_mtp import MtpTraining, load_base, load_config, rank_vocabulary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=64, help="one generation batch, half code, half chat")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after one untimed)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from ..chat import chat_prompt

    path = resolve_model(args.model)
    base, base_config = load_base(path)
    tokenizer = load_tokenizer(path)
    config = load_config(None, {})
    length = config["training"]["sequence_length"]
    code = line_prompts(code_texts(400_000, 10)[0], args.prompts // 2, 64, tokenizer, seed=0)
    chat = [tokenizer.encode(chat_prompt(tokenizer, [{"role": "user", "content": q}]), add_special_tokens=False)
            for q in chat_prompts(held_out=False)[: args.prompts - len(code)]]
    prompts = code + chat
    report = {"model": str(path), "windows": len(prompts), "length": length, "threads": args.threads}

    made, bfloat16 = {}, copy.deepcopy(base).to(torch.bfloat16)
    for name, model in (("float32", base), ("bfloat16", bfloat16)):
        continue_batch(model, prompts[:2], 72)  # warm-up
        start = time.perf_counter()
        made[name] = continue_batch(model, prompts, length)
        report[f"generate_seconds_{name}"] = round(time.perf_counter() - start, 2)
    written = torch.zeros_like(made["float32"]["ids"], dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        written[row, len(prompt):] = True
    report["bfloat16_generated_tokens_equal_to_float32"] = round(
        (made["bfloat16"]["ids"] == made["float32"]["ids"])[written].float().mean().item(), 4)

    # On the same text (float32's windows), how often bfloat16's greedy token is float32's: the label a
    # bfloat16-made window gives a row, against what float32 verification accepts.
    with torch.no_grad():
        head = bfloat16.get_output_embeddings().weight
        greedy = torch.cat([(bfloat16.model(input_ids=ids).last_hidden_state @ head.t()).argmax(-1)
                            for ids in made["float32"]["ids"].split(8)])
    report["bfloat16_greedy_equal_to_float32_on_the_same_text"] = round(
        (greedy == made["float32"]["greedy"]).float().mean().item(), 4)

    data = made["float32"]
    ranking = rank_vocabulary(data["greedy"], base_config.vocab_size)
    for name in ("float32", "bfloat16"):
        config["training"]["compute_dtype"] = name
        torch.manual_seed(0)
        task = MtpTraining(base, base_config, config, data, {}, ranking)
        optimizer = torch.optim.AdamW(task.modules.parameters(), lr=1e-3)
        seconds, losses = [], []
        for step in range(args.steps + 1):
            start = time.perf_counter()
            step_losses = task.batch_losses(torch.Generator().manual_seed(step))
            total = step_losses[0] + 0.6 * step_losses[1]
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
            losses.append(round(total.item(), 4))
        report[f"train_step_seconds_{name}"] = round(sum(seconds[1:]) / args.steps, 2)
        report[f"train_losses_{name}"] = losses
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
