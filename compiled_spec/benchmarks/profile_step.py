"""Where a decode step's time goes: torch.profiler over the steps of one warmed-up request.

    python -m compiled_spec.benchmarks.profile_step [--model DIR] [--graph-mode full] [-k 3 | --draft-tree 2,1] [--max-tokens 96] [--rows 15]
                                      [--max-seq-len 160] [--shapes]

The defaults match a `compiled-spec bench` cell at batch 1 (max_seq_len 160, one batch and one prefill bucket).

Inductor's C++ kernels are recorded by name (cpp.enable_kernel_profile), so the table shows fused kernels,
GEMMs and library calls side by side. Prints the top ops by self CPU time and the mean step latency.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from compiled_spec import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--graph-mode", default="full")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--draft-tree", default=None, metavar="W1,W2,...", help="a token tree (k: its depth)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompt", default="ROMEO:\n")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--max-seq-len", type=int, default=160)
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    parser.add_argument("--shapes", action="store_true", help="group ops by input shapes")
    parser.add_argument("--no-kernel-names", action="store_true",
                        help="do not record inductor's kernels by name (full: its dynamic-shape GEMMs fail to compile "
                             "with that on; the custom ops and library calls are still recorded)")
    args = parser.parse_args()

    torch._inductor.config.cpp.enable_kernel_profile = not args.no_kernel_names
    max_seq_len = args.max_seq_len
    k = len(args.draft_tree.split(",")) if args.draft_tree else args.num_speculative_tokens
    llm = LLM(args.model, num_speculative_tokens=k, draft_tree=args.draft_tree, graph_mode=args.graph_mode,
              max_batch_size=1, max_seq_len=max_seq_len, batch_buckets=(1,), prefill_buckets=(max_seq_len,))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompt = args.prompt if llm.tokenizer is not None else [1, 2, 3, 4]
    llm.generate(prompt, params)  # untimed: first-call costs
    llm.engine.step_seconds.clear()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as profiler:
        llm.generate(prompt, params)
    steps = llm.engine.step_seconds
    print(f"{args.graph_mode}, k={k}" + (f" tree {args.draft_tree}" if args.draft_tree else "") + f", batch 1: {len(steps)} steps, "
          f"mean {1000 * statistics.fmean(steps):.2f} ms (profiler overhead included), warm-up {llm.engine.startup.warmup_seconds:.0f} s")
    print(profiler.key_averages(group_by_input_shape=args.shapes).table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.trace:
        profiler.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
