"""MTP modules kept in a directory of their own (`mtp=DIR`, `--mtp DIR`), attached to a safetensors or GGUF base."""

import dataclasses
import os
from pathlib import Path

import pytest
from safetensors.torch import save_file

from compiled_spec import LLM, CompiledSpecError, SamplingParams
from compiled_spec.loading.registry import (MODELS, SHIPPED_MTP_ROOT, default_draft_vocab_size, default_num_speculative_tokens,
                                    model_path, shipped_mtp_modules)
from hf_reference import mtp_logits_per_depth
from tiny_checkpoints import build_mtp_layers, mtp_state_dict
from tiny_gguf import write_gguf

ENGINE = dict(graph_mode="eager", max_seq_len=64, max_batch_size=2, show_progress=False)
PROMPTS = ["ROMEO: But soft", "It is the east"]


def mtp_directory(path, model, layout="mtp-indexed"):
    layers = build_mtp_layers(model, 2)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in mtp_state_dict(layers, layout, model.config.num_hidden_layers).items()},
              str(path / "mtp.safetensors"))
    return layers


def run(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    return [o.token_ids for o in outputs], [o.stats for o in outputs]


@pytest.mark.parametrize("layout", ["mtp-indexed", "deepseek"])
def test_mtp_modules_from_a_directory_draft_for_a_gguf_base_losslessly(tmp_path, layout):
    gguf_path, model = write_gguf(tmp_path, "llama", "F32")
    layers = mtp_directory(tmp_path / "mtp", model, layout)
    plain = LLM(gguf_path, num_speculative_tokens=0, **ENGINE)
    with_mtp = LLM(gguf_path, mtp=tmp_path / "mtp", num_speculative_tokens=2, **ENGINE)
    assert with_mtp.model_config.num_mtp_modules == 2
    tokens, stats = run(with_mtp)
    assert tokens == run(plain)[0]  # greedy speculative output equals plain decoding
    assert all(s.steps > 0 and s.drafted == 2 * s.steps for s in stats)  # every step verified 2 drafts
    # The attached modules compute what transformers' MtpLayer computes from the same weights.
    ids = with_mtp.encode(PROMPTS[0] + " what light through yonder window")
    expected = mtp_logits_per_depth(model, layers, ids, depths=2)
    for depth in (1, 2):
        assert (with_mtp.mtp_logits(ids, depth=depth) - expected[depth - 1]).abs().max().item() <= 1e-4

def test_an_mtp_directory_with_other_weights_or_none_is_refused(tmp_path, tiny_checkpoint):
    source = tiny_checkpoint("llama").path
    with pytest.raises(CompiledSpecError, match="holds weights that are not MTP modules"):
        LLM(source, mtp=source, **ENGINE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CompiledSpecError, match="no \\*.safetensors files"):
        LLM(source, mtp=tmp_path / "empty", **ENGINE)
    with pytest.raises(CompiledSpecError, match="is not a directory"):
        LLM(source, mtp=tmp_path / "missing", **ENGINE)


def test_a_named_models_own_default_k_comes_only_with_its_shipped_modules(tmp_path, monkeypatch):
    gguf = model_path("smollm2-135m")
    shipped = shipped_mtp_modules(gguf)
    assert shipped == SHIPPED_MTP_ROOT / "smollm2-135m" and MODELS["smollm2-135m"].num_speculative_tokens == 2
    # Its own k made unlike the default of 3 for any other modules, so that the two are told apart.
    monkeypatch.setitem(MODELS, "smollm2-135m", dataclasses.replace(MODELS["smollm2-135m"], num_speculative_tokens=1))
    assert default_num_speculative_tokens(gguf, shipped, 2, "mtp") == 1
    assert default_num_speculative_tokens(gguf, Path(os.path.relpath(shipped)), 2, "mtp") == 1
    assert default_num_speculative_tokens(gguf, tmp_path / "mtp", 2, "mtp") == 3  # modules of one's own
    assert default_num_speculative_tokens(gguf, shipped, 0, "mtp") == 0
    assert default_num_speculative_tokens(tmp_path / "other.gguf", None, 2, "mtp") == 3


def test_a_named_models_own_draft_vocabulary_comes_only_with_its_shipped_modules(tmp_path):
    gguf = model_path("smollm2-135m")
    shipped = shipped_mtp_modules(gguf)
    assert MODELS["smollm2-135m"].draft_vocab_size == 8192
    assert default_draft_vocab_size(gguf, shipped) == 8192
    assert default_draft_vocab_size(gguf, Path(os.path.relpath(shipped))) == 8192
    assert default_draft_vocab_size(gguf, tmp_path / "mtp") is None  # modules of one's own: their trained size
    assert default_draft_vocab_size(tmp_path / "other.gguf", None) is None
