"""Train the embedded default model (Llama + MTP modules on Shakespeare) and export it.

    python -m compiled_spec.training.train --config compiled_spec/training/train_config.json [--resume]
    python -m compiled_spec.training.train --config ... --measure-steps 5   # seconds/step only
"""
import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from compiled_spec.training import loop
from compiled_spec.training.corpus import fetch_texts_dir, read_works, split_works
from compiled_spec.training.mtp_reference import LlamaWithMtp, build_llama_config, export_state_dict
from compiled_spec.training.train_tokenizer import train_byte_level_bpe

def tokenize_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each followed by EOS."""
    ids = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, batch_size: int, sequence_length: int, generator: torch.Generator):
    starts = torch.randint(0, len(stream) - sequence_length, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + sequence_length] for s in starts.tolist()])


def evaluation_windows(stream: torch.Tensor, sequence_length: int, max_windows: int | None) -> torch.Tensor:
    windows = stream[: len(stream) // sequence_length * sequence_length].view(-1, sequence_length)
    if max_windows is not None and max_windows < len(windows):
        windows = windows[torch.linspace(0, len(windows) - 1, max_windows).long()]
    return windows


def depth_losses(logits_per_depth, input_ids, distill_fraction: float) -> list[torch.Tensor]:
    """Loss per depth. Depth m row i targets t[i+m+1]; MTP depths also distill from the main
    model's (detached) distribution at row i+m, the token greedy verification will compare with."""
    main_logits = logits_per_depth[0][:, :-1]
    losses = [F.cross_entropy(main_logits.flatten(0, 1), input_ids[:, 1:].flatten())]
    for depth, logits in enumerate(logits_per_depth[1:], start=1):
        logits = logits[:, :-1].flatten(0, 1)
        cross_entropy = F.cross_entropy(logits, input_ids[:, depth + 1 :].flatten())
        loss = cross_entropy
        if distill_fraction > 0:
            teacher = main_logits[:, depth:].detach().flatten(0, 1).log_softmax(-1)
            distill = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="batchmean")
            loss = (1 - distill_fraction) * cross_entropy + distill_fraction * distill
        losses.append(loss)
    return losses


@torch.no_grad()
def evaluate(model: LlamaWithMtp, windows: torch.Tensor, batch_size: int) -> dict:
    """Teacher-forced metrics per depth: CE loss and top-1 accuracy against the text, and for MTP
    depths top-1 agreement with the main model's greedy token at the same target position (the loop puts the
    model in eval mode around this call)."""
    num_depths = 1 + len(model.mtp_modules)
    loss_sum, correct, agree, count = [0.0] * num_depths, [0] * num_depths, [0] * num_depths, [0] * num_depths
    for batch in windows.split(batch_size):
        logits_per_depth = model(batch)
        main_greedy = logits_per_depth[0][:, :-1].argmax(-1)
        for depth, logits in enumerate(logits_per_depth):
            logits = logits[:, :-1]
            targets = batch[:, depth + 1 :]
            loss_sum[depth] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            predicted = logits.argmax(-1)
            correct[depth] += (predicted == targets).sum().item()
            agree[depth] += (predicted == main_greedy[:, depth:]).sum().item()
            count[depth] += targets.numel()
    return {
        "loss": [s / n for s, n in zip(loss_sum, count)],
        "top1_accuracy": [c / n for c, n in zip(correct, count)],
        "top1_agreement_with_main_greedy": [a / n for a, n in zip(agree[1:], count[1:])],
        "tokens_per_depth": count,
    }


def check_export_matches(model: LlamaWithMtp, output_dir: Path, windows: torch.Tensor) -> float:
    """transformers must load the export (MTP keys only 'unexpected') with identical main logits."""
    loaded = LlamaForCausalLM.from_pretrained(str(output_dir)).eval()
    model.eval()
    with torch.no_grad():
        sample = windows[:2]
        difference = (loaded(sample).logits - model(sample)[0]).abs().max().item()
    model.train()
    if difference > 1e-4:
        raise RuntimeError(f"exported main logits differ from the training model by {difference}")
    return difference


def export_default_model(model, tokenizer, output_dir: Path, log: dict, check_windows: torch.Tensor,
                         depth_names: list[str]) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    staging = output_dir.parent / (output_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    model.config.save_pretrained(str(staging))
    save_file(export_state_dict(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(staging))
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
                     do_sample=False).save_pretrained(str(staging))
    log["export_check_max_abs_logit_difference"] = check_export_matches(model, staging, check_windows)
    loop.plot_loss_curve(log["history"], staging / "loss_curve.png", depth_names, "Llama + MTP on Shakespeare")
    (staging / "training_log.json").write_text(json.dumps(log, indent=2))
    for path in staging.iterdir():
        os.replace(path, output_dir / path.name)  # per file, so readers never see a half-written file
    staging.rmdir()


def prepare_tokenizer_and_data(config: dict, work_dir: Path, resume: bool):
    works = read_works(fetch_texts_dir(work_dir))
    train_texts, validation_texts = split_works(works, config["corpus"]["validation_works"])
    tokenizer_dir = work_dir / "tokenizer"
    if resume and (tokenizer_dir / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    else:
        tokenizer = train_byte_level_bpe(train_texts, config["tokenizer"]["vocab_size"])
        tokenizer.save_pretrained(str(tokenizer_dir))
    return tokenizer, tokenize_stream(tokenizer, train_texts), tokenize_stream(tokenizer, validation_texts)


def train(config: dict, resume: bool, measure_steps: int | None = None) -> dict:
    training = config["training"]
    work_dir, output_dir = loop.prepare(config)

    tokenizer, train_stream, validation_stream = prepare_tokenizer_and_data(config, work_dir, resume)
    llama_config = build_llama_config(config["model"], len(tokenizer), tokenizer.eos_token_id)
    model = LlamaWithMtp(llama_config, config["model"]["num_nextn_predict_layers"])
    sequence_length, batch_size = training["sequence_length"], training["batch_size"]
    validation_windows = evaluation_windows(validation_stream, sequence_length, None)
    periodic_windows = evaluation_windows(validation_stream, sequence_length, training["eval_windows"])
    log = {
        "config": config,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(train_stream),
        "validation_tokens": len(validation_stream),
        "history": {"train": [], "validation": []},
    }

    def batch_losses(generator):
        batch = sample_batch(train_stream, batch_size, sequence_length, generator)
        return depth_losses(model(batch), batch, training["mtp_distill_fraction"])

    depth_names = ["main"] + [f"MTP depth {m}" for m in range(1, len(model.mtp_modules) + 1)]
    task = loop.Task(
        model=model,
        batch_losses=batch_losses,
        loss_weights=[1.0] + training["mtp_loss_weights"],
        evaluate=lambda final: evaluate(model, validation_windows if final else periodic_windows, batch_size),
        export=lambda step, log: export_default_model(model, tokenizer, output_dir, log, periodic_windows, depth_names),
        depth_names=depth_names,
        title="Llama + MTP on Shakespeare",
    )
    return loop.run(task, training, config, work_dir, log, resume, measure_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--resume", action="store_true", help="continue from <work_dir>/checkpoint.pt")
    parser.add_argument("--measure-steps", type=int, help="run this many steps and print seconds/step; exports nothing")
    args = parser.parse_args()
    config = json.loads(args.config.read_text())
    log = train(config, args.resume, args.measure_steps)
    if args.measure_steps is not None:
        measured = [s for s in log["measured_step_seconds"][1:] if s is not None]
        print(f"seconds/step (mean of steps after the first): {sum(measured) / len(measured):.3f}")


if __name__ == "__main__":
    main()
