"""How fast full's frozen GEMMs stream their weights over 1 and k+1 rows: the C++ GEMM template (its micro-kernel as
full compiles it with its entry, compiler/micro_gemm_kernel.py, and as torch ships them) against ATen.

    python -m compiled_spec.benchmarks.gemm_rows [--rows 1,3] [--layers 30] [--threads 2] [--out DIR]

A stack of SmolLM2-135M-sized MLPs (576 -> 1536 gate and up, 1536 -> 576 down, no bias) is exported and compiled
by AOTInductor with full's CPU options (max-autotune, freezing) and each GEMM choice, then timed over each row
count. The weights (about 318 MB at 30 layers) do not fit in most caches (a VM here had 480 MB of L3), so every call
streams them once, as a decode step does: the table gives the p50 time and the GB/s it implies, and the read
bandwidth of the machine measured in the same run. Writes results.json and results.md to --out when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from compiled_spec.config import GraphMode
from compiled_spec.model.layers import MLP
from compiled_spec.compiler import torch_patches
from compiled_spec.compiler.step_runner import inductor_options
from compiled_spec.compiler.micro_gemm_kernel import (TEMPLATE_ENTRY_AS_SHIPPED, TEMPLATE_KERNEL_AS_SHIPPED,
                                                    cpp_micro_gemm)

from .bandwidth import read_bandwidth_gb_s

# name -> (inductor options on top of full's, the template's micro-kernel and entry sources or None for full's own)
BACKENDS = {
    "C++ GEMM template (full)": ({}, None),
    "C++ GEMM template as torch ships it": ({}, (TEMPLATE_KERNEL_AS_SHIPPED, TEMPLATE_ENTRY_AS_SHIPPED)),
    "ATen, plain weights": ({"max_autotune_gemm_backends": "ATEN", "cpp.weight_prepack": False}, None),
}


class Residual(torch.nn.Module):
    """The engine's MLP with its residual add, as in a decoder layer."""

    def __init__(self, hidden: int = 576, intermediate: int = 1536):
        super().__init__()
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x):
        return x + self.mlp(x)


def time_calls(function, x, calls: int = 60) -> float:
    for _ in range(5):
        function(x)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        function(x)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,3", help="row counts, comma-separated (a k=2 step verifies 3)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch_patches.install()  # full's micro-kernel and entry, as an engine compiles them
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Residual() for _ in range(args.layers))).eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Inductor's caches do not tell the two micro-kernel sources apart.
    base = {**inductor_options(GraphMode.FULL, torch.device("cpu")), "force_disable_caches": True}
    records = []
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, 576)
            expected = model(x)
            exported = torch.export.export(model, (x,))
            for backend, (options, micro_kernel) in BACKENDS.items():
                start = time.perf_counter()
                micro_gemm = cpp_micro_gemm.CppMicroGemmFP32Vec
                kernel, entry = micro_kernel or (micro_gemm.TEMPLATE_KERNEL, micro_gemm.TEMPLATE_ENTRY)
                with mock.patch.object(micro_gemm, "TEMPLATE_KERNEL", kernel), \
                        mock.patch.object(micro_gemm, "TEMPLATE_ENTRY", entry):
                    path = torch._inductor.aoti_compile_and_package(
                        exported, package_path=f"{folder}/{len(records)}.pt2", inductor_configs={**base, **options})
                compile_seconds = time.perf_counter() - start
                compiled = torch._inductor.aoti_load_package(path)
                torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-4)
                seconds = time_calls(compiled, x)
                records.append(dict(rows=rows, backend=backend, ms=1000 * seconds, gb_s=weight_bytes / seconds / 1e9,
                                    compile_s=compile_seconds))
                print(f"{rows} rows, {backend}: {records[-1]['ms']:.2f} ms, {records[-1]['gb_s']:.1f} GB/s", flush=True)
    bandwidth = read_bandwidth_gb_s(args.threads)
    lines = [f"{args.layers} MLPs, {weight_bytes / 1e6:.0f} MB of weights, {args.threads} threads; read bandwidth "
             f"{bandwidth:.1f} GB/s", "", "| rows | GEMMs | p50 ms | weights streamed at | compile s |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['backend']} | {r['ms']:.2f} | {r['gb_s']:.1f} GB/s | {r['compile_s']:.0f} |"
              for r in records]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(layers=args.layers, weight_bytes=weight_bytes, threads=args.threads, read_gb_s=bandwidth,
                    torch=torch.__version__)
        (out / "results.json").write_text(json.dumps(dict(meta, records=records), indent=2) + "\n")
        (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
