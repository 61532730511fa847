"""Every SmolLM2-135M matrix once (30 layers and the tied head, as the Q4_1 file stores them), over 1 to 16 rows:
the packed kernel (model/packed_linear.py) against float32 F.linear over the dequantized weights and torch's
weight-only int8 kernel (aten._weight_int8pack_mm, bfloat16 activations: its vectorized CPU path). The best of two
best-of-5 runs per kind and row count; timings on a shared machine drift, so compare kinds within one run.

    python -m compiled_spec.benchmarks.packed_rows [--threads 2] [--rows 1,4,8,16] [--kinds packed,float32,int8pack]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from compiled_spec import fetch_model
from compiled_spec.loading.gguf_checkpoint import read_gguf
from compiled_spec.model import cpu_kernels
from compiled_spec.model.packed_linear import dequantize_rows, packed_linear


def best_ms(run, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--kinds", default="packed,float32,int8pack", help="which multiplications to time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        raise SystemExit("the CPU kernels did not build here")
    _, tensors = read_gguf(fetch_model("smollm2-135m"))
    matrices = [tensor for tensor in tensors.values() if hasattr(tensor, "qweight")]
    kinds = args.kinds.split(",")
    widened = [dequantize_rows(m.qweight, m.scales, m.mins) for m in matrices] if kinds != ["packed"] else []
    int8 = []
    for weight in widened if "int8pack" in kinds else []:
        scale = weight.abs().amax(1) / 127
        int8.append(((weight / scale[:, None]).round().to(torch.int8), scale.to(torch.bfloat16)))
    print(f"weights: packed {sum(m.nbytes for m in matrices) / 1e6:.1f} MB, "
          f"float32 {sum(4 * m.shape[0] * m.shape[1] for m in matrices) / 1e6:.1f} MB; {args.threads} threads")
    titles = {"packed": "packed", "float32": "float32 F.linear", "int8pack": "int8pack (bf16 x)"}
    print("| rows | " + " | ".join(f"{titles[kind]} ms" for kind in kinds) + " |\n" + "|---" * (len(kinds) + 1) + "|")
    for rows in map(int, args.rows.split(",")):
        xs = [torch.randn(rows, m.shape[1]) for m in matrices]
        halves = [x.bfloat16() for x in xs]
        runs = {
            "packed": lambda: [packed_linear(x, m.qweight, m.scales, m.mins) for m, x in zip(matrices, xs)],
            "float32": lambda: [F.linear(x, w) for w, x in zip(widened, xs)],
            "int8pack": lambda: [torch.ops.aten._weight_int8pack_mm(x, q, s) for (q, s), x in zip(int8, halves)],
        }
        times = [min(best_ms(runs[kind]) for _ in range(2)) for kind in kinds]
        print(f"| {rows} | " + " | ".join(f"{ms:.2f}" for ms in times) + " |")


if __name__ == "__main__":
    main()
