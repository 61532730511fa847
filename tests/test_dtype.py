"""LLM(dtype=...) takes a name, a torch.dtype, or "auto" (the checkpoint's dtype from config.json)."""

import json
import shutil

import pytest
import torch

from compiled_spec import LLM, CompiledSpecError


def engine_dtype(path, dtype):
    llm = LLM(path, dtype=dtype, num_speculative_tokens=1, graph_mode="eager", max_seq_len=32, max_batch_size=1)
    assert llm.engine.state.main_keys[0].dtype == llm.config.torch_dtype()
    return llm.config.torch_dtype()


@pytest.mark.parametrize("dtype, expected", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             ("float16", torch.float16)])
def test_names_and_torch_dtypes(tiny_checkpoint, dtype, expected):
    assert engine_dtype(tiny_checkpoint("llama").path, dtype) == expected


def test_auto_is_the_checkpoints_dtype(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("llama").path
    assert json.loads((source / "config.json").read_text())["dtype"] == "float32"
    assert engine_dtype(source, "auto") == torch.float32
    copy = tmp_path / "bf16"
    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (copy / "config.json").write_text(json.dumps(config))
    assert engine_dtype(copy, "auto") == torch.bfloat16


def test_an_unsupported_torch_dtype_is_named(tiny_checkpoint):
    with pytest.raises(CompiledSpecError, match=r"dtype=torch.float64 is not supported; choose float32, bfloat16 "
                                                r"or float16 \(as names or torch dtypes\), or auto"):
        LLM(tiny_checkpoint("llama").path, dtype=torch.float64)
