"""Packed weights (loading/quantized_weights.py, model/packed_linear.py): the repack is exact, the kernel multiplies every row
count a decode step or verify pass has, and a packed tiny GGUF decodes in `full` as in eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from compiled_spec import LLM, SamplingParams
from compiled_spec.model import cpu_kernels
from compiled_spec.model.packed_linear import PackedLinear, dequantize_rows, packed_linear, weight_format
from compiled_spec.loading.quantized_weights import PACKED_TYPES, pack
from tiny_gguf import quantize, write_gguf

# 72 weight rows: threads' chunks end mid-way; two K-quant blocks per row. 74 x 544: a tile of fewer weight rows at
# the end, and an odd number of 32-value blocks per row (the 4-bit layout's lone last block).
SHAPES = [(tensor_type, (72, 512)) for tensor_type in PACKED_TYPES] + [
    (tensor_type, (74, 544)) for tensor_type in ("Q4_0", "Q4_1", "Q8_0")]


def quantized(tensor_type: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1
    return quantize(values, tensor_type)


@pytest.mark.parametrize("tensor_type, shape", SHAPES)
def test_packed_rows_widen_to_gguf_dequantize_bitwise(tensor_type, shape):
    data = quantized(tensor_type, shape)
    want = torch.from_numpy(dequantize(data, getattr(GGMLQuantizationType, tensor_type)).astype(np.float32))
    packed = pack(data, tensor_type)
    assert packed.shape == shape
    assert torch.equal(dequantize_rows(packed.qweight, packed.scales, packed.mins), want)
    index = torch.tensor([[5, 0], [71, 5]])
    module = packed.module(embedding=True)
    module.load_state_dict(packed.parts(), assign=True)
    assert torch.equal(module(index), want[index])


@pytest.mark.parametrize("tensor_type, shape", SHAPES)
def test_kernel_equals_the_dequantized_product_for_every_row_count(tensor_type, shape):
    assert cpu_kernels.load()
    data = quantized(tensor_type, shape, seed=1)
    weight = torch.from_numpy(dequantize(data, getattr(GGMLQuantizationType, tensor_type)).astype(np.float64))
    packed = pack(data, tensor_type)
    generator = torch.Generator().manual_seed(0)
    # 1..(k + 1) x batch rows for k <= 3 and batches up to 8, then the tiled GEMM path of a prefill.
    for rows in [*range(1, 13), 16, 24, 31, 32, 33, 100]:
        x = torch.randn(rows, shape[1], generator=generator)
        got = packed_linear(x.view(1, rows, shape[1]), packed.qweight, packed.scales, packed.mins)[0]
        assert got.shape == (rows, shape[0])
        torch.testing.assert_close(got.double(), x.double() @ weight.t(), rtol=0, atol=2e-5)


def test_dequantize_keeps_float_weights_and_the_same_logits(tmp_path):
    path, _ = write_gguf(tmp_path, "llama", "Q4_1", tie_word_embeddings=True)
    settings = dict(num_speculative_tokens=0, graph_mode="eager", max_seq_len=64, max_batch_size=1,
                    show_progress=False)
    packed, widened = LLM(path, **settings), LLM(path, dequantize=True, **settings)
    assert weight_format(packed.model) == "Q4_1 packed" and weight_format(widened.model) == "float32"
    assert not any(isinstance(module, PackedLinear) for module in widened.model.modules())
    ids = packed.encode("ROMEO: But soft")
    assert (packed.logits(ids) - widened.logits(ids)).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_full_packages_multiply_packed_weights_as_eager_does(tmp_path):
    path, _ = write_gguf(tmp_path, "llama", "Q4_1", tie_word_embeddings=True)
    settings = dict(num_speculative_tokens=0, max_seq_len=64, max_batch_size=2, batch_buckets=(2,),
                    prefill_buckets=(16,), show_progress=False)
    prompts = ["ROMEO: But soft, what light", "It is the east"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eager = LLM(path, graph_mode="eager", **settings).generate(prompts, params)
    full = LLM(path, graph_mode="full", compile_workers=1, **settings)
    assert [o.token_ids for o in full.generate(prompts, params)] == [o.token_ids for o in eager]
