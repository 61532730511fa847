"""Compiled CPU decode passes attend with the C++ kernel (decode_attention), or with grouped_attention where it cannot
be built; both must equal SDPA, the attention eager and prefill use. A prefill attends over its prompt's cache rows
only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from compiled_spec import LLM, SamplingParams
from compiled_spec.model import cpu_kernels
from compiled_spec.model.layers import (
    COMPILED_ATTENTION_MAX_ROWS,
    DECODE_ATTENTION_MAX_ROWS,
    attend_with_cache,
    grouped_attention,
)


def causal_rows(batch: int, length: int, capacity: int, first: list[int]) -> torch.Tensor:
    """attend [B, 1, T, S]: row t of sequence b sees cache positions 0..first[b] + t."""
    last = torch.tensor(first)[:, None] + torch.arange(length)[None, :]
    return (torch.arange(capacity)[None, None, :] <= last[:, :, None])[:, None]


def sdpa(q, keys, values, attend):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=attend, enable_gqa=True
    ).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 4])
def test_grouped_attention_equals_sdpa(heads, kv_heads, length):
    generator = torch.Generator().manual_seed(heads * 10 + length)
    batch, capacity, dim = 3, 37, 16
    q = torch.randn(batch, length, heads, dim, generator=generator)
    keys = torch.randn(batch, capacity, kv_heads, dim, generator=generator)
    values = torch.randn(batch, capacity, kv_heads, dim, generator=generator)
    attend = causal_rows(batch, length, capacity, [0, 11, capacity - length])
    torch.testing.assert_close(grouped_attention(q, keys, values, attend), sdpa(q, keys, values, attend),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (14, 2, 64), (6, 3, 20)])
@pytest.mark.parametrize("length", [1, 4, 9])
def test_decode_attention_kernel_equals_sdpa(heads, kv_heads, dim, length):
    """Every head grouping the kernel takes (1-3 query heads of a kv head at once, 7 in two blocks and one), head
    sizes of whole vectors and not, causal rows and rows with holes."""
    assert cpu_kernels.load(), "the kernel must build on a machine with a C++ compiler"
    generator = torch.Generator().manual_seed(heads * 100 + dim + length)
    batch, capacity = 3, 53
    q = torch.randn(batch, length, heads, dim, generator=generator)
    keys = torch.randn(batch, capacity, kv_heads, dim, generator=generator)
    values = torch.randn(batch, capacity, kv_heads, dim, generator=generator)
    kernel = torch.ops.compiled_spec_cpu.decode_attention
    causal = causal_rows(batch, length, capacity, [0, 17, capacity - length])
    torch.testing.assert_close(kernel(q, keys, values, causal), sdpa(q, keys, values, causal), rtol=1e-5, atol=1e-5)
    holes = torch.rand(batch, 1, length, capacity, generator=generator) < 0.3
    holes[..., 5] = True
    torch.testing.assert_close(kernel(q, keys, values, holes), sdpa(q, keys, values, holes), rtol=1e-5, atol=1e-5)


def test_decode_attention_kernel_gives_zeros_to_a_row_that_attends_to_nothing_and_names_bad_input():
    assert cpu_kernels.load()
    q, keys, values = torch.randn(1, 2, 4, 16), torch.randn(1, 10, 2, 16), torch.randn(1, 10, 2, 16)
    attend = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    attend[0, 0, 1, :4] = True
    out = torch.ops.compiled_spec_cpu.decode_attention(q, keys, values, attend)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    torch.testing.assert_close(out[:, 1:], sdpa(q, keys, values, attend)[:, 1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.compiled_spec_cpu.decode_attention(q.double(), keys.double(), values.double(), attend)
    with pytest.raises(RuntimeError, match=r"\[B, 1, T, S\] = \[1, 1, 2, 10\]; got \[1, 1, 2, 9\]"):
        torch.ops.compiled_spec_cpu.decode_attention(q, keys, values, attend[..., :9])
    with pytest.raises(RuntimeError, match=r"keys and values must both be .* got \[1, 10, 2, 16\] and \[1, 9, 2, 16\]"):
        torch.ops.compiled_spec_cpu.decode_attention(q, keys, values[:, :9], attend)
    with pytest.raises(RuntimeError, match=r"heads \(4\) must be a multiple of kv_heads \(3\)"):
        torch.ops.compiled_spec_cpu.decode_attention(q, torch.randn(1, 10, 3, 16), torch.randn(1, 10, 3, 16), attend)


def attention_ops_compiled(length: int) -> set[str]:
    """The attention ops in the graph torch.compile traces for attend_with_cache over `length` rows."""
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    batch, capacity, heads, kv_heads, dim = 2, 64, 4, 2, 8
    q = torch.randn(batch, length, heads, dim)
    k, v = torch.randn(batch, length, kv_heads, dim), torch.randn(batch, length, kv_heads, dim)
    key_cache, value_cache = torch.zeros(batch, capacity, kv_heads, dim), torch.zeros(batch, capacity, kv_heads, dim)
    write_index = torch.arange(length).expand(batch, length)
    attend = causal_rows(batch, length, capacity, [0, 0])
    compiled = torch.compile(attend_with_cache, backend=backend, fullgraph=True, dynamic=False)
    out = compiled(q, k, v, key_cache, value_cache, torch.arange(batch), write_index, attend, True)
    torch.testing.assert_close(out, sdpa(q, key_cache, value_cache, attend), rtol=1e-5, atol=1e-5)
    return {target for target in seen if "scaled_dot_product" in target or "decode_attention" in target}


def test_compiled_decode_passes_use_the_kernel_and_longer_passes_sdpa():
    assert cpu_kernels.load()
    assert attention_ops_compiled(1) == {"compiled_spec_cpu.decode_attention"}
    assert attention_ops_compiled(DECODE_ATTENTION_MAX_ROWS) == {"compiled_spec_cpu.decode_attention"}
    assert "compiled_spec_cpu.decode_attention" not in attention_ops_compiled(DECODE_ATTENTION_MAX_ROWS + 1)


def test_without_the_kernel_compiled_decode_passes_use_grouped_attention_and_longer_passes_sdpa(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "loaded", lambda: False)
    torch._dynamo.reset()
    try:
        assert attention_ops_compiled(COMPILED_ATTENTION_MAX_ROWS) == set()
        assert attention_ops_compiled(COMPILED_ATTENTION_MAX_ROWS + 1) != set()
    finally:
        torch._dynamo.reset()


class KeyLengths(TorchDispatchMode):
    """Records how many cache positions each SDPA call attends over."""

    def __init__(self):
        super().__init__()
        self.lengths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.lengths.append(args[1].shape[-2])  # keys [B, kv_heads, S, D]
        return func(*args, **(kwargs or {}))


def test_a_prefill_attends_over_its_prompt_width_not_the_whole_cache(tiny_checkpoint):
    """Every row of a prefill, the draft depths' included, lies within the prompt, so its attention reads that many
    cache positions: its cost follows the prompt, not max_seq_len."""
    llm = LLM(tiny_checkpoint("predictive").path, num_speculative_tokens=2, max_seq_len=64, graph_mode="eager",
              show_progress=False)
    width = llm.engine.prefill_buckets[0]  # a 5-token prompt is padded to the smallest bucket
    assert width < llm.engine.state.cache_capacity
    with KeyLengths() as keys:
        llm.generate([[5, 9, 2, 7, 1]], SamplingParams(max_tokens=1))  # a prefill, and no step
    assert keys.lengths == [width] * (llm.model_config.num_hidden_layers + 2)
