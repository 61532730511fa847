"""The main model's logits equal transformers' on the same checkpoint, for every supported variant."""

import json

import pytest
import torch

from compiled_spec.api import LLM
from hf_reference import main_hidden_and_logits

# Past the rope-scaling checkpoints' original_max_position_embeddings (16), so the scaling matters.
LONG = [(7 * i + 3) % 96 for i in range(40)]
# Few enough tokens that the MoE takes its gather-the-chosen-experts path (tokens * top_k <= experts).
SHORT = [5, 17, 42]

VARIANTS = [
    "llama", "llama_tied", "llama_bias", "llama_rope_llama3", "llama_sharded",
    "qwen2", "qwen2_yarn", "qwen3", "glm4_moe", "glm4_moe_bias",
]


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_transformers(tiny_checkpoint, name):
    checkpoint = tiny_checkpoint(name)
    llm = LLM(checkpoint.path, num_speculative_tokens=0, max_seq_len=48)
    for ids in (LONG, SHORT):
        _, expected = main_hidden_and_logits(checkpoint.model, ids)
        ours = llm.logits(ids)
        assert ours.shape == expected.shape
        assert (ours - expected).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("name", ["llama_rope_llama3", "qwen2_yarn"])
def test_rope_scaling_changes_the_logits_it_is_checked_on(tiny_checkpoint, name):
    """The scaled-rope parity test has teeth: the same weights with plain rope give other logits."""
    checkpoint = tiny_checkpoint(name)
    config = type(checkpoint.model.config).from_dict(checkpoint.model.config.to_dict())
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = type(checkpoint.model)(config).eval()
    plain.load_state_dict(checkpoint.model.state_dict())
    _, scaled_logits = main_hidden_and_logits(checkpoint.model, LONG)
    _, plain_logits = main_hidden_and_logits(plain, LONG)
    assert (scaled_logits - plain_logits).abs().max().item() > 1e-2
    llm = LLM(checkpoint.path, num_speculative_tokens=0, max_seq_len=48)
    assert llm.model_config.rope_scaling["rope_type"] == checkpoint.model.config.rope_parameters["rope_type"]


def test_tied_checkpoint_has_no_head_and_uses_the_embedding(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama_tied")
    from safetensors import safe_open

    with safe_open(str(checkpoint.path / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" not in handle.keys()
    llm = LLM(checkpoint.path, num_speculative_tokens=0, max_seq_len=48)
    assert llm.model.lm_head is None
    untied = LLM(tiny_checkpoint("llama").path, num_speculative_tokens=0, max_seq_len=48)
    assert untied.model.lm_head is not None


def test_sharded_checkpoint_loads_every_shard(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama_sharded")
    index = json.loads((checkpoint.path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (checkpoint.path / "model.safetensors").exists()
    llm = LLM(checkpoint.path, num_speculative_tokens=2, max_seq_len=48)
    assert llm.model_config.num_mtp_modules == 2  # the MTP weights live in a shard of their own
    expected = checkpoint.model.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(llm.model.layers[1].mlp.down_proj.weight, expected)
