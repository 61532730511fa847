"""The drafts' matrices in each storage format a quantized target could give them: SmolLM2-135M's shipped MTP
modules (every depth's projection, attention and MLP) and its draft head, as float16 (half_weight_linear, the
default) and as Q8_0 / Q4_0 packed (packed_linear, quantized with the gguf package), at the rows a step gives them:
1 (the draft head, one row per sequence) and k + 1 (a depth's rows at batch 1). Best of 5 per format and row count,
formats taken in turn so a slow moment lands on all of them.

    python -m compiled_spec.benchmarks.draft_formats [--threads 2] [--rows 1,4]
"""

from __future__ import annotations

import argparse
import time

import torch
from gguf import GGMLQuantizationType, quants

from compiled_spec import LLM
from compiled_spec.model import cpu_kernels
from compiled_spec.model.half_weight_linear import HalfWeightLinear
from compiled_spec.model.packed_linear import packed_linear
from compiled_spec.loading.quantized_weights import pack

FORMATS = ("float16", "Q8_0", "Q4_0")


def packed(weight: torch.Tensor, format: str):
    blocks = quants.quantize(weight.float().numpy(), getattr(GGMLQuantizationType, format))
    return pack(blocks, format)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        raise SystemExit("the CPU kernels did not build here")
    llm = LLM("smollm2-135m", graph_mode="eager", warm_up=False, show_progress=False)
    model = llm.engine.model
    halves = [m.weight for m in model.modules() if isinstance(m, HalfWeightLinear)]
    weights = {"float16": halves, **{f: [packed(w, f) for w in halves] for f in FORMATS[1:]}}
    sizes = {"float16": sum(w.nbytes for w in halves), **{f: sum(m.nbytes for m in weights[f]) for f in FORMATS[1:]}}
    print(f"{len(halves)} draft matrices, {sum(w.numel() for w in halves) / 1e6:.1f} M weights; {args.threads} threads")
    print("| rows | " + " | ".join(f"{f} ms" for f in FORMATS) + " |\n" + "|---" * (len(FORMATS) + 1) + "|")
    for rows in map(int, args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1]) for w in halves]
        runs = {
            "float16": lambda: [torch.ops.compiled_spec_cpu.half_weight_linear(x, w) for w, x in zip(halves, xs)],
            **{f: (lambda f=f: [packed_linear(x, m.qweight, m.scales, m.mins) for m, x in zip(weights[f], xs)])
               for f in FORMATS[1:]},
        }
        best = dict.fromkeys(FORMATS, float("inf"))
        for _ in range(5):
            for f in FORMATS:
                start = time.perf_counter()
                runs[f]()
                best[f] = min(best[f], time.perf_counter() - start)
        print(f"| {rows} | " + " | ".join(f"{1e3 * best[f]:.2f}" for f in FORMATS) + " |")
    print("| MB | " + " | ".join(f"{sizes[f] / 1e6:.1f}" for f in FORMATS) + " |")


if __name__ == "__main__":
    main()
