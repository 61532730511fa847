"""How fast a start could be: one decode-step bucket as an AOTInductor package instead of torch.compile.

    python -m benchmarks.aot_package [--model DIR] [-k 2] [--batch 1] [--max-batch-size 8] [--max-seq-len 160]
                                     [--out aot_out]

Exports the speculative step for one batch bucket (the state's tensors as inputs, mutated in place),
compiles it with the `full` mode's inductor options (max-autotune, freezing on CPU) into a package,
loads the package back, and decodes the same prompts with it and with eager, one request at a time:
tokens and accepted drafts must be equal. Reports export, compile and load seconds and the median
step time of both. The engine's passes (audit, state_mutation) are not run on this graph, and only
the one bucket is packaged, so this measures the path, it does not serve requests.
Writes aot_package.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.config import GraphMode
from compiled_spec.runtime.graph_modes import inductor_options
from compiled_spec.spec.state import DecodeState
from compiled_spec.spec.step import speculative_step

PROMPTS = ("ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.", "KING HENRY:\nOnce more")


class StepBucket(torch.nn.Module):
    """speculative_step for one batch size, as a module of the state's tensors (in DecodeState.tensors() order)."""

    def __init__(self, llm: LLM, batch: int):
        super().__init__()
        self.model = llm.model
        self.constants = llm.engine.constants
        self.batch = batch
        state = llm.engine.state
        self.layout = [(f.name, len(v) if isinstance(v := getattr(state, f.name), list) else None)
                       for f in dataclasses.fields(DecodeState)]

    def forward(self, *tensors):
        fields, at = {}, 0
        for name, count in self.layout:
            fields[name] = tensors[at] if count is None else list(tensors[at:at + count])
            at += 1 if count is None else count
        speculative_step(self.model, DecodeState(**fields), self.constants, self.batch)


def decode(llm: LLM, prompts, new_tokens: int):
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)
    llm.engine.step_seconds.clear()
    outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    return [o.token_ids for o in outputs], [o.stats.accepted for o in outputs], statistics.median(llm.engine.step_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="the batch bucket to package")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=160)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--out", default="aot_out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    llm = LLM(args.model, num_speculative_tokens=args.num_speculative_tokens, graph_mode="eager",
              max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    prompts = [llm.encode(text) for text in PROMPTS]
    eager_tokens, eager_accepted, eager_step = decode(llm, prompts, args.new_tokens)

    state = llm.engine.state
    start = time.perf_counter()
    with torch.no_grad():
        exported = torch.export.export(StepBucket(llm, args.batch), tuple(state.tensors()), strict=False)
    export_s = time.perf_counter() - start
    options = {k: v for k, v in inductor_options(GraphMode.FULL, state.seq_lens.device).items() if k != "triton.cudagraphs"}
    start = time.perf_counter()
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(out / f"step_b{args.batch}.pt2"),
                                                       inductor_configs=options)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    runner = torch._inductor.aoti_load_package(package)
    load_s = time.perf_counter() - start

    tensors = state.tensors()
    llm.engine.batch_buckets = [args.batch]  # one request at a time: every step runs this bucket
    llm.engine.runner.step = lambda batch: runner(*tensors)
    tokens, accepted, step = decode(llm, prompts, args.new_tokens)

    result = {
        "model": str(llm.path), "k": args.num_speculative_tokens, "batch_bucket": args.batch,
        "max_batch_size": args.max_batch_size, "max_seq_len": args.max_seq_len, "threads": torch.get_num_threads(),
        "export_s": export_s, "compile_s": compile_s, "load_s": load_s,
        "package_mib": Path(package).stat().st_size / 2**20,
        "eager_step_ms": 1000 * eager_step, "package_step_ms": 1000 * step,
        "accepted": accepted, "equal_to_eager": tokens == eager_tokens and accepted == eager_accepted,
    }
    (out / "aot_package.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
