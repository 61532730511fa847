"""llama.cpp as a bench anchor, through llama-cpp-python, on the same GGUF file and prompt token ids:

- llama-cpp:     the file as it is (e.g. SmolLM2's Q4_1, llama.cpp's quantized kernels);
- llama-cpp-f32: the same weights dequantized to F32 (what a float engine computes in), a GGUF written once
                 beside the original (benchmarks/gguf_copy.py);
- llama-cpp-lookup: the file as it is with prompt lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding),
                 at each of LOOKUP_PREDICTED_TOKENS drafts per step; the best counts, every one is recorded.

Greedy (top_k=1), EOS ignored: exactly max_tokens tokens per prompt, one prompt at a time (llama-cpp-python
decodes one sequence per context). Runs in a worker process.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from .gguf_copy import gguf_copy
from .unavailable import Unavailable
from .workload import digest

LLAMA_CPP_ANCHORS = ("llama-cpp", "llama-cpp-f32", "llama-cpp-lookup")
LOOKUP_PREDICTED_TOKENS = (2, 3, 5, 10)  # num_pred_tokens tried; 10 is llama-cpp-python's default


def unavailable_reason(name: str, batch_size: int, model: str) -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python builds it from source)"
    if not model.endswith(".gguf"):
        return "llama.cpp needs a GGUF file; this model is a checkpoint directory"
    if batch_size != 1:
        return "llama-cpp-python decodes one sequence at a time (batch size 1 only)"
    return None


def measure_llama_cpp(spec: dict) -> dict:
    from llama_cpp import Llama

    name, max_tokens = spec["anchor"], spec["max_tokens"]
    reason = unavailable_reason(name, spec["batch_size"], spec["model"])
    if reason:
        raise Unavailable(reason)
    start = time.perf_counter()
    path = Path(spec["model"])
    if name == "llama-cpp-f32":
        path = gguf_copy(path, "F32")
    threads = spec.get("threads") or len(os.sched_getaffinity(0))
    if name != "llama-cpp-lookup":
        return _measure(Llama, path, spec, threads, start, None)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    runs = {count: _measure(Llama, path, spec, threads, start, LlamaPromptLookupDecoding(num_pred_tokens=count))
            for count in LOOKUP_PREDICTED_TOKENS}
    best = max(runs, key=lambda count: runs[count]["tokens_per_s"])
    record = dict(runs[best])
    record["settings"] = {**record["settings"], "num_pred_tokens": best,
                          "tokens_per_s_by_num_pred_tokens": {str(c): r["tokens_per_s"] for c, r in runs.items()}}
    return record


def _measure(Llama, path: Path, spec: dict, threads: int, start: float, draft_model) -> dict:
    max_tokens = spec["max_tokens"]
    longest = max(len(ids) for ids in spec["prompt_ids"])
    llm = Llama(model_path=str(path), n_ctx=longest + max_tokens + 16, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False, draft_model=draft_model)

    def generate(prompt_ids: list[int]) -> list[int]:
        return greedy_tokens(llm, prompt_ids, max_tokens)

    warm = time.perf_counter()
    generate(spec["prompt_ids"][0][:4])
    record = {"warmup_s": time.perf_counter() - warm, "setup_s": time.perf_counter() - start,
              "settings": {"gguf": path.name, "n_threads": threads}}
    best = None
    for _ in range(spec["repeats"]):
        begin = time.perf_counter()
        outputs = [generate(ids) for ids in spec["prompt_ids"]]
        elapsed = time.perf_counter() - begin
        if best is None or elapsed < best[0]:
            best = (elapsed, outputs)
    elapsed, outputs = best
    generated = sum(len(tokens) for tokens in outputs)
    record.update(tokens_per_s=generated / elapsed, generated_tokens=generated, requests=len(outputs),
                  elapsed_s=elapsed, output_digests=[digest(tokens) for tokens in outputs])
    return record


def greedy_tokens(llm, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation of prompt_ids (a llama_cpp.Llama), EOS ignored: exactly max_tokens tokens."""
    tokens = []
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens
