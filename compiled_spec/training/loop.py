"""The training loop both trainers share: AdamW with warm-up and cosine decay, a tqdm bar, a JSON log with
periodic validation, a loss plot, and checkpoints that resume exactly (weights, optimizer, batch order, RNGs).

train.py trains the embedded model from scratch; train_mtp.py trains MTP modules on a frozen base model.
Each supplies what differs through a Task.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import pickle
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..errors import CompiledSpecError

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class Task:
    model: torch.nn.Module  # what is optimized and checkpointed (a frozen base model stays outside it)
    # Losses for one batch drawn with the generator: [main or depth 1, ...]; the total weighs them by loss_weights.
    batch_losses: Callable[[torch.Generator], list[torch.Tensor]]
    loss_weights: list[float]
    evaluate: Callable[[bool], dict]  # final=True: the whole validation set
    export: Callable[[int, dict], None]  # (step, log) -> writes the output
    depth_names: list[str]
    title: str


def keep_freed_memory() -> None:
    """Let glibc keep large freed blocks for reuse. By default it returns every block over 32 MB (an MTP step's
    logits are 268 MB) to the system and the next step faults it back in page by page (docs/mtp-training.md, "The
    recipe", has the cost). Nothing to do where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    largest = 2**31 - 1  # mallopt takes a C int
    for option, value in ((M_MMAP_THRESHOLD, largest), (M_TRIM_THRESHOLD, largest), (M_TOP_PAD, 256 << 20)):
        mallopt(option, value)


def prepare(config: dict) -> tuple[Path, Path]:
    """Threads and seeds as the config says, freed memory kept for reuse; returns (work dir, created, and output
    dir)."""
    keep_freed_memory()
    torch.set_num_threads(config["training"]["num_threads"])
    random.seed(config["seed"])
    torch.manual_seed(config["seed"])
    work_dir, output_dir = Path(config["work_dir"]), Path(config["output_dir"])
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir, output_dir


def learning_rate_at(step: int, training: dict) -> float:
    peak = training["learning_rate"]
    if step < training["warmup_steps"]:
        return peak * (step + 1) / training["warmup_steps"]
    progress = (step - training["warmup_steps"]) / max(1, training["max_steps"] - training["warmup_steps"])
    floor = peak * training["min_learning_rate_ratio"]
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, training: dict) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": training["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=training["learning_rate"], betas=tuple(training["adam_betas"]),
    )


def plot_loss_curve(history: dict, path: Path, depth_names: list[str], title: str,
                    ylabel: str = "cross-entropy (nats/token)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for depth, name in enumerate(depth_names):
        color = f"C{depth}"
        steps = [row["step"] for row in history["train"]]
        axis.plot(steps, [row["loss_per_depth"][depth] for row in history["train"]], color=color, alpha=0.5,
                  label=f"train {name}")
        if history["validation"]:
            axis.plot([row["step"] for row in history["validation"]],
                      [row["loss"][depth] for row in history["validation"]], "o-", color=color, label=f"val {name}")
    axis.set_xlabel("step")
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def save_checkpoint(path: Path, model, optimizer, step: int, generator: torch.Generator, log: dict) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "batch_generator": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "log": log,
    }
    save_atomically(state, path)


def save_atomically(obj, path: Path) -> None:
    """torch.save through a temporary file, so a run stopped mid-write leaves the previous file whole."""
    temporary = path.with_suffix(".tmp")
    torch.save(obj, temporary)
    os.replace(temporary, path)


def run(task: Task, training: dict, config: dict, work_dir: Path, log: dict, resume: bool,
        measure_steps: int | None = None) -> dict:
    """Trains to training["max_steps"] (or measure_steps more steps, exporting nothing) and returns the log."""
    optimizer = make_optimizer(task.model, training)
    generator = torch.Generator().manual_seed(config["seed"])
    start_step, checkpoint_path = 0, work_dir / CHECKPOINT_NAME
    if resume and checkpoint_path.exists():
        try:  # tensors and plain data only: a pickled checkpoint could run any code it names
            state = torch.load(checkpoint_path, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CompiledSpecError(f"{checkpoint_path} holds more than tensors and plain data; it is not loaded "
                                    f"({str(error).splitlines()[0]})") from None
        task.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["batch_generator"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        # The config and the data's provenance are this run's; the history is the checkpoint's.
        start_step, log = state["step"], {**state["log"], **{key: log[key] for key in ("config", "data_provenance")
                                                             if key in log}}

    last_step = training["max_steps"] if measure_steps is None else start_step + measure_steps
    task.model.train()
    progress = tqdm(range(start_step, last_step), initial=start_step, total=last_step, mininterval=5)
    step_seconds = []
    for step in progress:
        step_start = time.time()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, training)
        losses = task.batch_losses(generator)
        total = losses[0] * task.loss_weights[0] + sum(w * loss for w, loss in zip(task.loss_weights[1:], losses[1:]))
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), training["grad_clip_norm"])
        optimizer.step()
        step_seconds.append(time.time() - step_start)
        progress.set_postfix(loss=f"{total.item():.3f}", first=f"{losses[0].item():.3f}")
        done = step + 1

        if done % training["log_every"] == 0 or done == last_step:
            log["history"]["train"].append({
                "step": done, "learning_rate": learning_rate_at(step, training), "loss": total.item(),
                "loss_per_depth": [loss.item() for loss in losses],
                "seconds_per_step": sum(step_seconds) / len(step_seconds), "wall_time": time.time(),
            })
            step_seconds = []
        if measure_steps is not None:
            log.setdefault("measured_step_seconds", []).append(step_seconds[-1] if step_seconds else None)
            continue
        if done % training["eval_every"] == 0 or done == last_step:
            task.model.eval()
            metrics = task.evaluate(done == last_step)
            task.model.train()
            log["history"]["validation"].append({"step": done, "windows": "all" if done == last_step else
                                                 training["eval_windows"], **metrics})
            tqdm.write(f"step {done} validation {json.dumps(metrics)}")
        if done % training["checkpoint_every"] == 0 or done == last_step:
            save_checkpoint(checkpoint_path, task.model, optimizer, done, generator, log)
        if done == training.get("midpoint_export_step") or done == last_step:
            log["exported_at_step"] = done
            if done == last_step:
                log["final_validation"] = log["history"]["validation"][-1]
            task.export(done, log)
            tqdm.write(f"step {done}: exported")
    return log
