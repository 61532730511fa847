"""compiled_spec.benchmarks.gguf_copy: the benchmark's Q8_0 (and F32) twin of a GGUF file is the same model,
requantized the way the gguf package quantizes, metadata and all; this engine loads it packed."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from gguf.quants import quantize

from compiled_spec.benchmarks.gguf_copy import gguf_copy
from compiled_spec import LLM
from compiled_spec.model.packed_linear import weight_format
from tiny_gguf import write_gguf


def test_a_q8_0_copy_requantizes_every_matrix_keeps_the_rest_and_loads_packed(tmp_path):
    path, _ = write_gguf(tmp_path, "llama", "F32")
    copy = gguf_copy(path, "Q8_0")
    assert copy.name == "model.Q8_0.gguf" and gguf_copy(path, "Q8_0") == copy  # written once
    original, copied = GGUFReader(str(path)), GGUFReader(str(copy))
    assert copied.fields["general.file_type"].contents() == 7
    assert {name for name in original.fields if not name.startswith("GGUF.")} <= set(copied.fields)
    by_name = {tensor.name: tensor for tensor in copied.tensors}
    quantized = 0
    for tensor in original.tensors:
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        twin = by_name[tensor.name]
        if values.ndim == 2 and values.shape[-1] % 32 == 0:
            assert twin.tensor_type == GGMLQuantizationType.Q8_0
            expected = dequantize(quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
            np.testing.assert_array_equal(dequantize(twin.data, twin.tensor_type), expected)
            quantized += 1
        else:
            assert twin.tensor_type == GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.array(twin.data), values)
    assert quantized >= 7 * 2  # every layer's projections
    llm = LLM(copy, graph_mode="eager", max_seq_len=32)
    assert weight_format(llm.model).startswith("Q8_0")
