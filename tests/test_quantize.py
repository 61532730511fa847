"""Quantize at load (LLM(quantize=...), checkpoint.quantize_matrices): a float checkpoint's matrices become the
blocks the gguf package's quantizer writes, packed as a GGUF file's blocks are, so the model is the one a GGUF file
of that type holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quants
from torch import nn

from compiled_spec import LLM, CompiledSpecError, SamplingParams
from compiled_spec.model.packed_linear import PackedEmbedding, PackedLinear
from tiny_checkpoints import write_checkpoint
from tiny_gguf import write_gguf

SETTINGS = dict(graph_mode="eager", max_seq_len=64, max_batch_size=2, show_progress=False)


@pytest.mark.parametrize("quantize,tied", [("q8_0", False), ("q4_0", True)])
def test_a_float_gguf_quantized_at_load_is_the_gguf_file_of_that_type(tmp_path, quantize, tied):
    for folder in ("f32", "q"):
        (tmp_path / folder).mkdir()
    float_path, _ = write_gguf(tmp_path / "f32", "llama", "F32", tie_word_embeddings=tied)
    quantized_path, _ = write_gguf(tmp_path / "q", "llama", quantize.upper(), tie_word_embeddings=tied)
    at_load = LLM(float_path, quantize=quantize, num_speculative_tokens=0, **SETTINGS)
    from_file = LLM(quantized_path, num_speculative_tokens=0, **SETTINGS)
    assert at_load.weight_format == from_file.weight_format == f"{quantize.upper()} packed"
    assert isinstance(at_load.model.embed_tokens, PackedEmbedding)
    assert at_load.model.state_dict().keys() == from_file.model.state_dict().keys()
    for name, tensor in from_file.model.state_dict().items():
        assert torch.equal(at_load.model.state_dict()[name], tensor), name
    ids = at_load.encode("ROMEO: But soft")
    assert torch.equal(at_load.logits(ids), from_file.logits(ids))


def test_a_safetensors_checkpoint_quantized_at_load(tmp_path):
    """Linear weights and the embedding whose rows are whole 32-value blocks are packed, exactly gguf's
    quantize-then-dequantize of the float weights; 48-wide rows and the MTP modules stay float; speculative greedy
    output on them equals plain greedy output."""
    model, _ = write_checkpoint(tmp_path, architecture="llama", hidden_size=48, intermediate_size=96)
    llm = LLM(tmp_path, quantize="q8_0", num_speculative_tokens=2, **SETTINGS)
    assert llm.weight_format == "Q8_0 packed"
    reference = model.state_dict()
    packed = {name: module for name, module in llm.model.named_modules() if isinstance(module, PackedLinear)}
    # down_proj has 96 columns and o_proj 64 (4 heads of 16); the rest have 48
    assert sorted(packed) == [f"layers.{i}.{name}" for i in (0, 1) for name in ("mlp.down_proj", "self_attn.o_proj")]
    for name, module in packed.items():
        weight = reference[f"model.{name}.weight"].numpy()
        want = dequantize(quants.quantize(weight, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        assert torch.equal(module.rows(torch.arange(module.out_features)), torch.from_numpy(want.astype(np.float32)))
    assert type(llm.model.layers[0].self_attn.q_proj) is nn.Linear and type(llm.model.embed_tokens) is nn.Embedding
    assert all(not isinstance(module, PackedLinear) for module in llm.model.mtp.modules())
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    speculative = llm.generate([[2, 3, 4], [5, 6]], params)
    llm.config.num_speculative_tokens = 0
    assert [o.token_ids for o in llm.generate([[2, 3, 4], [5, 6]], params)] == [o.token_ids for o in speculative]


def test_bad_quantize_values_are_named(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama").path
    with pytest.raises(CompiledSpecError, match=r"quantize='q5_0' .*allowed: q8_0, q4_0") as error:
        LLM(path, quantize="q5_0", **SETTINGS)
    assert error.value.param == "quantize"
    with pytest.raises(CompiledSpecError, match=r"quantize='q8_0' with dequantize=True"):
        LLM(path, quantize="q8_0", dequantize=True, **SETTINGS)
    quantized_path, _ = write_gguf(tmp_path, "llama", "Q4_1")
    with pytest.raises(CompiledSpecError, match=r"model.gguf is already quantized \(Q4_1\)"):
        LLM(quantized_path, quantize="q4_0", **SETTINGS)
