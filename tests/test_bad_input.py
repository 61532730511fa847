"""Bad input gets a CompiledSpecError naming the bad value and what is allowed; one bad request never harms the others."""

import json
import shutil

import pytest

from compiled_spec.api import LLM
from compiled_spec.config import MAX_SPECULATIVE_TOKENS
from compiled_spec.errors import CompiledSpecError
from compiled_spec.params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama").path, num_speculative_tokens=2, max_seq_len=16, max_batch_size=2)


def copy_checkpoint(source, target):
    shutil.copytree(source, target)
    return target


def test_empty_prompt_list(llm):
    with pytest.raises(CompiledSpecError, match="empty prompt list"):
        llm.generate([])


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([], "empty prompt; a prompt needs at least one token"),
        ("", "empty prompt; a prompt needs at least one token"),
        (list(range(16)), r"prompt of 16 tokens is too long; max_seq_len=16 allows prompts of at most 15 tokens"),
        ([3, 96], r"token ids must be integers in 0\.\.95"),
        ([3, -1], r"token ids must be integers in 0\.\.95"),
        ("hello", "has no tokenizer; pass prompts as lists of token ids"),
    ],
)
def test_bad_prompt_is_reported_on_its_output(llm, prompt, message):
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=3))
    assert output.finish_reason == "error"
    assert output.token_ids == []
    assert output.error is not None
    import re

    assert re.search(message, output.error), output.error


def test_bad_request_does_not_harm_the_others(llm):
    good = [[5, 6, 7], [9], [40, 41, 42, 43, 44]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [llm.generate([prompt], params)[0].token_ids for prompt in good]
    mixed = llm.generate([good[0], [], good[1], list(range(20)), [1, 500], good[2]], params)
    assert [o.finish_reason for o in mixed] == ["length", "error", "length", "error", "error", "length"]
    assert [mixed[i].token_ids for i in (0, 2, 5)] == alone
    assert "too long" in mixed[3].error and "0..95" in mixed[4].error


@pytest.mark.parametrize("k", [-1, MAX_SPECULATIVE_TOKENS + 1, 2.0])
def test_speculative_tokens_out_of_range(tiny_checkpoint, k):
    with pytest.raises(CompiledSpecError, match=rf"num_speculative_tokens={k!r} is out of range; allowed 0\.\.{MAX_SPECULATIVE_TOKENS}"):
        LLM(tiny_checkpoint("llama").path, num_speculative_tokens=k, max_seq_len=16)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.5), r"temperature=-0\.5 is invalid; allowed: a number in 0\.\.100"),
        (dict(top_p=0.0), r"top_p=0\.0 is out of range; allowed \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1\.5 is out of range; allowed \(0, 1\]"),
        (dict(top_k=-2), r"top_k=-2 is invalid"),
        (dict(max_tokens=0), r"max_tokens=0 is invalid; allowed: a positive integer"),
        (dict(seed=2**63), r"seed=9223372036854775808 is out of range; allowed 0\.\.2\*\*63-1"),
        (dict(seed=-1), r"seed=-1 is out of range"),
        (dict(stop=[""]), r"stop=\[''\] is invalid"),
        (dict(temperature=float("nan")), r"temperature=nan is invalid; allowed: a number in 0\.\.100"),
        (dict(temperature=float("inf")), r"temperature=inf is invalid; allowed: a number in 0\.\.100"),
        (dict(temperature=1e308), r"temperature=1e\+308 is invalid; allowed: a number in 0\.\.100"),
        (dict(max_tokens=2**63), r"max_tokens=9223372036854775808 is invalid; allowed: a positive integer up to "
                                 r"2147483647"),
        (dict(top_k=2**63), r"top_k=9223372036854775808 is invalid; allowed: 0 \(off\) or an integer in "
                            r"1\.\.2147483647"),
        (dict(stop=["a"] * 17), r"stop has 17 strings; allowed: at most 16"),
        (dict(stop=["a" * 257]), r"stop has a string of 257 characters; allowed: at most 256 characters each"),
        (dict(num_speculative_tokens=9), r"num_speculative_tokens=9 is invalid; allowed: an integer in 0\.\.8 or 'auto'"),
        (dict(num_speculative_tokens="fast"), r"num_speculative_tokens='fast' is invalid"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(CompiledSpecError, match=message):
        SamplingParams(**kwargs)


def test_a_vanishing_temperature_decodes_greedily(llm):
    greedy, tiny = llm.generate([[5, 6, 7]] * 2, [SamplingParams(max_tokens=8, ignore_eos=True),
                                                  SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-40)])
    assert tiny.token_ids == greedy.token_ids and tiny.finish_reason == "length"


def test_unknown_graph_mode(tiny_checkpoint):
    with pytest.raises(CompiledSpecError, match=r"unknown graph mode 'turbo'; choose one of: eager, compile, piecewise, full"):
        LLM(tiny_checkpoint("llama").path, graph_mode="turbo")


@pytest.mark.parametrize("max_seq_len", [1, 10_000])
def test_max_seq_len_out_of_range(tiny_checkpoint, max_seq_len):
    with pytest.raises(CompiledSpecError, match=rf"max_seq_len={max_seq_len} is out of range; allowed 2\.\.256"):
        LLM(tiny_checkpoint("llama").path, max_seq_len=max_seq_len)


def test_path_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CompiledSpecError, match="no config.json in"):
        LLM(tmp_path)
    with pytest.raises(CompiledSpecError, match="is not a directory"):
        LLM(tmp_path / "missing")


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("llama").path, tmp_path / "gpt2")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CompiledSpecError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        LLM(path)


@pytest.mark.parametrize("damage", ["truncate", "corrupt_header", "empty"])
def test_damaged_safetensors(tiny_checkpoint, tmp_path, damage):
    path = copy_checkpoint(tiny_checkpoint("llama").path, tmp_path / damage)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "corrupt_header":
        data = data[:8] + b"\x07not json at all" + data[24:]
    else:
        data = b""
    weights.write_bytes(data)
    with pytest.raises(CompiledSpecError, match=r"cannot read model\.safetensors: the safetensors file is truncated or corrupt"):
        LLM(path)


def test_missing_weight(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny_checkpoint("llama").path, tmp_path / "missing")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.q_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CompiledSpecError, match=r"missing weights: layers\.1\.self_attn\.q_proj\.weight"):
        LLM(path)


def test_mixed_mtp_layouts(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny_checkpoint("llama").path, tmp_path / "mixed")
    state = load_file(str(path / "model.safetensors"))
    mimo = load_file(str(tiny_checkpoint("llama_mimo").path / "model.safetensors"))
    state.update({key: value for key, value in mimo.items() if key.startswith("model.mtp_layers.")})
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CompiledSpecError, match=r"checkpoint mixes MTP layouts \(deepseek-v3, mimo\); expected one"):
        LLM(path)


def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(CompiledSpecError, match="2 sampling params for 3 prompts; pass one, or one per prompt"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])


def test_unsupported_dtype(tiny_checkpoint):
    with pytest.raises(CompiledSpecError, match=r"dtype='float64' is not supported; choose float32, bfloat16 or float16"):
        LLM(tiny_checkpoint("llama").path, dtype="float64")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors"])
def test_a_safetensors_index_naming_a_file_outside_the_checkpoint_is_rejected(tiny_checkpoint, tmp_path, shard):
    path = copy_checkpoint(tiny_checkpoint("llama_sharded").path, tmp_path / "checkpoint")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, first_shard = next(iter(index["weight_map"].items()))
    target = (path / shard).resolve() if not shard.startswith("/") else tmp_path / "absolute.safetensors"
    shutil.copy(path / first_shard, target)  # the file exists: only the check keeps it from being read
    index["weight_map"][name] = shard if not shard.startswith("/") else str(target)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CompiledSpecError, match=r"model\.safetensors\.index\.json names shards outside the "
                                                r"checkpoint folder: .*; allowed: file names relative to"):
        LLM(path, max_seq_len=16)


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(draft_tree="2,5"), r"width 5 is out of range; allowed 1\.\.4"),
        (dict(draft_tree="2,x"), r"not a comma-separated list of widths"),
        (dict(draft_tree=()), r"draft_tree is empty"),
        (dict(draft_tree="2,1", num_speculative_tokens=3), r"draft_tree='2,1' is 2 deep but num_speculative_tokens=3"),
        (dict(draft_tree="2,1,1,1", num_speculative_tokens="auto", max_speculative_tokens=3),
         r"is 4 deep; with num_speculative_tokens='auto' it may be at most max_speculative_tokens=3 deep"),
    ],
)
def test_bad_draft_tree(tiny_checkpoint, settings, message):
    with pytest.raises(CompiledSpecError, match=message) as error:
        LLM(tiny_checkpoint("llama").path, max_seq_len=16, max_batch_size=2, warm_up=False, **settings)
    assert error.value.param == "draft_tree"
