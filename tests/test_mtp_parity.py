"""MTP module outputs equal transformers' MtpLayer on the same weights, in every MTP checkpoint layout."""

import pytest

from compiled_spec.api import LLM
from compiled_spec.errors import CompiledSpecError
from hf_reference import mtp_logits_per_depth

IDS = [(11 * i + 5) % 96 for i in range(24)]

# (checkpoint, layout its MTP weights are stored in)
VARIANTS = [
    ("llama", "deepseek"),
    ("llama_mimo", "mimo"),
    ("llama_mtp_indexed", "mtp-indexed"),
    ("qwen3_mtp_flat", "mtp-flat"),
    ("llama_sharded", "deepseek"),
    ("llama_tied", "deepseek"),
    ("qwen3", "deepseek"),
    ("glm4_moe", "deepseek"),
]


@pytest.mark.parametrize("name,layout", VARIANTS)
def test_mtp_logits_match_transformers_mtp_layer(tiny_checkpoint, name, layout):
    checkpoint = tiny_checkpoint(name)
    llm = LLM(checkpoint.path, num_speculative_tokens=2, max_seq_len=32)
    num_modules = len(checkpoint.mtp_layers)
    assert llm.model_config.num_mtp_modules == num_modules == (1 if layout == "mtp-flat" else 2)
    assert all(module.hidden_first == (layout == "mimo") for module in llm.model.mtp)
    expected = mtp_logits_per_depth(checkpoint.model, checkpoint.mtp_layers, IDS, depths=2)
    for depth in range(1, num_modules + 1):
        ours = llm.mtp_logits(IDS, depth=depth)
        assert ours.shape == (len(IDS) - depth, checkpoint.model.config.vocab_size)
        assert (ours - expected[depth - 1]).abs().max().item() <= 1e-4, (name, depth)


def test_mimo_order_matters(tiny_checkpoint):
    """The hidden-first check has teeth: reading MiMo weights embedding-first gives other logits."""
    checkpoint = tiny_checkpoint("llama_mimo")
    hidden_first = mtp_logits_per_depth(checkpoint.model, checkpoint.mtp_layers, IDS, depths=1)[0]
    config = checkpoint.mtp_layers[0].config
    config.mtp_hidden_states_first = False
    try:
        embedding_first = mtp_logits_per_depth(checkpoint.model, checkpoint.mtp_layers, IDS, depths=1)[0]
    finally:
        config.mtp_hidden_states_first = True
    assert (hidden_first - embedding_first).abs().max().item() > 1e-2


def test_glm4_moe_mtp_block_is_moe(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("glm4_moe").path, num_speculative_tokens=1, max_seq_len=32)
    assert type(llm.model.mtp[0].block.mlp).__name__ == "MoE"


def test_mtp_depth_out_of_range(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama").path, num_speculative_tokens=2, max_seq_len=32)
    with pytest.raises(CompiledSpecError, match=r"depth=3 is out of range; allowed 1\.\.2"):
        llm.mtp_logits(IDS, depth=3)
