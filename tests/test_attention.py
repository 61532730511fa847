"""Compiled decode passes attend with grouped_attention; it must equal SDPA, the attention eager and prefill use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_spec.model.layers import COMPILED_ATTENTION_MAX_ROWS, attend_with_cache, grouped_attention


def causal_rows(batch: int, length: int, capacity: int, first: list[int]) -> torch.Tensor:
    """attend [B, 1, T, S]: row t of sequence b sees cache positions 0..first[b] + t."""
    last = torch.tensor(first)[:, None] + torch.arange(length)[None, :]
    return (torch.arange(capacity)[None, None, :] <= last[:, :, None])[:, None]


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 4])
def test_grouped_attention_equals_sdpa(heads, kv_heads, length):
    generator = torch.Generator().manual_seed(heads * 10 + length)
    batch, capacity, dim = 3, 37, 16
    q = torch.randn(batch, length, heads, dim, generator=generator)
    keys = torch.randn(batch, capacity, kv_heads, dim, generator=generator)
    values = torch.randn(batch, capacity, kv_heads, dim, generator=generator)
    attend = causal_rows(batch, length, capacity, [0, 11, capacity - length])
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=attend, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(grouped_attention(q, keys, values, attend), expected, rtol=1e-5, atol=1e-5)


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
    reference = F.scaled_dot_product_attention(
        q.transpose(1, 2), key_cache.transpose(1, 2), value_cache.transpose(1, 2), attn_mask=attend, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    return {target for target in seen if "scaled_dot_product" in target}


def test_compiled_decode_passes_use_grouped_attention_and_longer_passes_sdpa():
    assert attention_ops_compiled(COMPILED_ATTENTION_MAX_ROWS) == set()
    assert attention_ops_compiled(COMPILED_ATTENTION_MAX_ROWS + 1) != set()
