"""One prepared command for a machine with a GPU: generate the self-distillation data with large batches, train
the MTP modules on it, and leave the result in files of at most 16 MiB each (the weights split where they are
larger), ready to be brought back.

    python -m compiled_spec.training.gpu_run --out DIR [--text-scale 3] [--device cuda] [--resume]

It runs train-mtp's recipe (train_mtp.py) with the shipped config, changed only where the options say: the
device, the generation batch, and `--text-scale` times the prose prompts and the fresh code-line prompts
(scaled_config). The data goes to WORK/shards (at most 16 MiB a shard) and a rerun resumes from
there and from WORK/checkpoint.pt; only DIR needs to come back.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .self_generated import SHARD_LIMIT_BYTES
from .train_mtp import load_config, train_mtp


def scaled_config(config: dict, text_scale: int) -> dict:
    """The config with text_scale times the prose prompts (the first of a larger count are the same) and, after all
    the config's code prompts, text_scale - 1 times as many line-end prompts as its fresh rounds draw
    (corpus.extra_code_prompts). The config's own prompts stay as they are. The def-line prompts are not scaled:
    the training modules have 12,103 def lines and the shipped config draws 10,240 of them (scaling each fresh
    round's line-end draws instead would leave the last round 3 def lines short, since a line-end draw can end on a
    def line: docs/mtp-training.md, "The data"). Chat keeps its prompts: the shipped config has all 9,912 there
    are."""
    corpus = config["corpus"]
    if "prose" in corpus["prompts"]:
        corpus["prompts"] = {**corpus["prompts"], "prose": corpus["prompts"]["prose"] * text_scale}
    fresh = corpus.get("fresh_code_prompts", 0) * corpus.get("fresh_code_rounds", 1)
    corpus["extra_code_prompts"] = corpus.get("extra_code_prompts", 0) + fresh * (text_scale - 1)
    return config


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="where the modules, config and log go")
    parser.add_argument("--work-dir", type=Path, default=None, help="shards and checkpoints [default: OUT.work]")
    parser.add_argument("--config", type=Path, default=None, help="[default: the shipped train_mtp_config.json]")
    parser.add_argument("--model", default=None, help="base model [default: the config's]")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--text-scale", type=int, default=3, help="times the prose and fresh code-line prompts [default: 3]")
    parser.add_argument("--generate-batch-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=None, help="windows a training step [default: config's]")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--generate-dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--max-file-mib", type=float, default=SHARD_LIMIT_BYTES / 2**20,
                        help="largest output file [default: 16]")
    parser.add_argument("--resume", action="store_true", help="continue from WORK/checkpoint.pt")
    args = parser.parse_args(argv)
    if args.text_scale < 1:
        parser.error(f"--text-scale {args.text_scale} is out of range; allowed: 1 or more (1: the shipped "
                     "config's text)")

    config = load_config(args.config, {"model": args.model})
    config = scaled_config(config, args.text_scale)
    config.update(output_dir=str(args.out), work_dir=str(args.work_dir or args.out.with_name(args.out.name + ".work")),
                  device=args.device, max_file_bytes=int(args.max_file_mib * 2**20))
    config["corpus"]["generate_batch_size"] = args.generate_batch_size
    for section, key, value in (("training", "batch_size", args.batch_size), ("training", "max_steps", args.max_steps),
                                ("corpus", "generate_dtype", args.generate_dtype),
                                ("training", "compute_dtype", args.compute_dtype)):
        if value is not None:
            config[section][key] = value
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32, as on the CPU
    log = train_mtp(config, resume=args.resume)
    oversized = [f"{path.name} ({path.stat().st_size} bytes)" for path in args.out.iterdir()
                 if path.stat().st_size > config["max_file_bytes"]]
    if oversized:
        raise SystemExit(f"files over {args.max_file_mib} MiB in {args.out}: {', '.join(oversized)}")
    print(json.dumps({"out": str(args.out), "train_tokens": log["train_tokens"],
                      "final_validation": log.get("final_validation")}, indent=2))
    return log


if __name__ == "__main__":
    main()
