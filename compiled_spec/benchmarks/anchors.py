"""The baselines a user would reach for first, on the same checkpoint, prompts and token counts, greedy:

- hf-eager:  transformers `generate`, eager, dynamic cache;
- hf-static: transformers `generate(cache_implementation="static")` with its own torch.compile of the forward
  (CompileConfig as transformers ships it; `_compile_all_devices` because generate compiles only on GPUs);
- hf-mtp:    transformers `generate(use_mtp=True)`: assisted generation drafting with the checkpoint's MTP layers;
- llama-cpp, llama-cpp-f32, llama-cpp-lookup: llama.cpp on a GGUF model, the last with prompt lookup decoding
  (benchmarks/llama_cpp_anchor.py).

A GGUF model is loaded into transformers with `from_pretrained(folder, gguf_file=name)`.

Batches are left-padded to their longest prompt; for hf-static to the longest prompt of the whole workload,
so the static cache and the compiled forward keep one shape. Runs in a worker process.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from .llama_cpp_anchor import LLAMA_CPP_ANCHORS, measure_llama_cpp
from .llama_cpp_anchor import unavailable_reason as llama_cpp_unavailable
from .unavailable import Unavailable
from .workload import digest

# torch and transformers are imported inside the functions: the sweep process reads ANCHORS without them.

ANCHORS = ("hf-eager", "hf-static", "hf-mtp", *LLAMA_CPP_ANCHORS)
DEFAULT_ANCHORS = ("hf-eager", "hf-static", "hf-mtp")


def unavailable_reason(name: str, batch_size: int, model: str) -> str | None:
    """Known before starting a process."""
    if name in LLAMA_CPP_ANCHORS:
        return llama_cpp_unavailable(name, batch_size, model)
    if name == "hf-mtp" and batch_size != 1:
        return "transformers assisted generation (use_mtp=True) supports batch size 1 only"
    return None


def load_model(path: str):
    import torch
    import transformers

    if path.endswith(".gguf"):
        file = Path(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                                  dtype=torch.float32).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Generate exactly max_new_tokens, like the engine cells with ignore_eos: EOS is an ordinary token.
    model.generation_config.eos_token_id = None
    return model


def enable_mtp(model) -> str | None:
    """Points transformers' MtpModel at the checkpoint's MTP weights; returns what had to be set, or None.

    transformers finds MTP weights through `config.num_mtp_layers` and the key patterns a model class lists in
    `_keys_to_ignore_on_load_unexpected` (Glm4Moe lists its layers 46/92). Llama, Qwen2 and Qwen3 list none,
    and their configs spell the count `num_nextn_predict_layers`, so both are set here for the DeepSeek
    layout (`model.layers.{N+j}.*`) that the engine also reads.
    """
    config = model.config
    set_here = []
    if getattr(config, "num_mtp_layers", None) is None:
        count = getattr(config, "num_nextn_predict_layers", None)
        if not count:
            raise Unavailable("the checkpoint's config declares no MTP layers (num_mtp_layers / num_nextn_predict_layers)")
        config.num_mtp_layers = count
        set_here.append(f"config.num_mtp_layers={count}")
    layers = config.num_hidden_layers
    patterns = [p for p in model._keys_to_ignore_on_load_unexpected or []
                if (m := re.search(r"\.(\d+)", p)) is None or int(m.group(1)) >= layers]
    if not patterns:
        model._keys_to_ignore_on_load_unexpected = [
            rf"model\.layers\.{layers + j}\..*" for j in range(config.num_mtp_layers)
        ]
        set_here.append("_keys_to_ignore_on_load_unexpected=model.layers.{N+j}.*")
    return ", ".join(set_here) or None


def batches(prompt_ids: list[list[int]], batch_size: int, pad_id: int, same_shape: bool):
    """(input_ids, attention_mask, real rows) per batch. same_shape: every batch is as long as the longest
    prompt and as wide as batch_size (a short last batch repeats its last prompt; only real rows count)."""
    import torch

    longest = max(len(ids) for ids in prompt_ids)
    for first in range(0, len(prompt_ids), batch_size):
        group = prompt_ids[first:first + batch_size]
        real = len(group)
        width = longest if same_shape else max(len(ids) for ids in group)
        if same_shape:
            group = group + [group[-1]] * (batch_size - real)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in group])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in group])
        yield input_ids, attention_mask, real


def measure_anchor(spec: dict) -> dict:
    import torch
    from transformers import CompileConfig

    name, batch_size, max_tokens = spec["anchor"], spec["batch_size"], spec["max_tokens"]
    if name in LLAMA_CPP_ANCHORS:
        return measure_llama_cpp(spec)
    reason = unavailable_reason(name, batch_size, spec["model"])
    if reason:
        raise Unavailable(reason)
    start = time.perf_counter()
    model = load_model(spec["model"])
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
    record = {"settings": {}}
    if name == "hf-static":
        compile_config = CompileConfig()
        compile_config._compile_all_devices = True
        kwargs.update(cache_implementation="static", compile_config=compile_config)
        record["settings"] = {"compile_config": compile_config.to_dict()}
    elif name == "hf-mtp":
        shim = enable_mtp(model)
        kwargs.update(use_mtp=True)
        record["settings"] = {"set_for_transformers": shim}
    forward_calls = [0]
    if name == "hf-mtp":  # counts verify passes; a hook would be traced into hf-static's compiled forward
        model.register_forward_hook(lambda *_: forward_calls.__setitem__(0, forward_calls[0] + 1))

    prompt_ids = spec["prompt_ids"]
    groups = list(batches(prompt_ids, batch_size, pad_id, same_shape=name == "hf-static"))
    with torch.inference_mode():
        warm = time.perf_counter()
        model.generate(groups[0][0], attention_mask=groups[0][1], **kwargs)  # compiles hf-static
        record["warmup_s"] = time.perf_counter() - warm
        record["setup_s"] = time.perf_counter() - start
        best = None
        for _ in range(spec["repeats"]):
            forward_calls[0] = 0
            outputs = []
            begin = time.perf_counter()
            for input_ids, attention_mask, real in groups:
                out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
                outputs += [row.tolist() for row in out[:real, input_ids.shape[1]:]]
            elapsed = time.perf_counter() - begin
            if best is None or elapsed < best[0]:
                best = (elapsed, outputs, forward_calls[0])
    elapsed, outputs, calls = best
    generated = sum(len(tokens) for tokens in outputs)
    record.update(
        tokens_per_s=generated / elapsed,
        generated_tokens=generated,
        requests=len(outputs),
        elapsed_s=elapsed,
        output_digests=[digest(tokens) for tokens in outputs],
    )
    if name == "hf-mtp":
        record["main_model_forward_calls"] = calls
        # Each generate: one prefill pass (1 token), then verify passes; tokens per verify pass.
        verify_passes = calls - len(groups)
        record["num_speculative_tokens"] = model.config.num_mtp_layers
        record["mean_accepted_length"] = (generated - len(groups)) / verify_passes if verify_passes else None
    return record
