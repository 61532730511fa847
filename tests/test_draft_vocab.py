"""Drafts over a sub-vocabulary (draft_vocab_size, the ranked `d2t` of an MTP directory) stay lossless: greedy
output equals k=0, and sampled tokens keep the target distribution because the accept test uses the q the draft
was sampled from, 0 outside the sub-vocabulary. A q that is not that one fails the same test."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_spec import LLM, CompiledSpecError, SamplingParams
from compiled_spec.model.causal_lm import CausalLM
from serving import write_chat_model
from test_sampling_lossless import BAD_P, GOOD_P, NUM_REQUESTS, SETTINGS, exact_joint, p_values, sample

ENGINE = dict(graph_mode="eager", max_seq_len=64, max_batch_size=4, show_progress=False)


def mtp_directory(checkpoint_dir, out, ranking: list[int] | None):
    """The checkpoint's own MTP modules (DeepSeek names), with a draft-vocabulary ranking when given."""
    tensors = load_file(str(checkpoint_dir / "model.safetensors"))
    num_layers = json.loads((checkpoint_dir / "config.json").read_text())["num_hidden_layers"]
    mtp = {k: v for k, v in tensors.items() if k.startswith("model.layers.") and int(k.split(".")[2]) >= num_layers}
    if ranking is not None:
        mtp["d2t"] = torch.tensor(ranking, dtype=torch.int32)
    out.mkdir()
    save_file(mtp, str(out / "mtp.safetensors"))
    return out


@pytest.fixture(scope="module")
def vocab6(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint("tiny_vocab")
    return checkpoint, mtp_directory(checkpoint.path, tmp_path_factory.mktemp("d2t") / "mtp", [3, 1, 4, 0, 2, 5])


def test_sub_vocabulary_drafts_keep_the_target_distribution(vocab6, monkeypatch):
    checkpoint, mtp = vocab6
    settings = SETTINGS["t1"]
    joint = exact_joint(checkpoint.model, settings)
    monkeypatch.setattr(LLM, "__init__", _with(LLM.__init__, mtp=mtp, draft_vocab_size=3))  # sample() makes the LLM
    tokens, outputs = sample(checkpoint.path, 2, settings, seed_offset=2 * NUM_REQUESTS)
    rates = np.mean([o.stats.acceptance_rate_per_position for o in outputs], axis=0)
    assert 0.05 < rates[0] < 0.9, rates
    assert min(p_values(tokens, joint).values()) > GOOD_P, p_values(tokens, joint)


def test_a_q_that_is_not_the_sampling_distribution_fails_the_same_test(vocab6, monkeypatch):
    """Wrong: the draft is sampled over the sub-vocabulary, but the accept test gets another q (uniform)."""
    checkpoint, mtp = vocab6

    def wrong(self, index, probs):
        token = self.draft_vocab[index]
        full = probs.new_full((*probs.shape[:-1], self.config.vocab_size), 1.0 / self.config.vocab_size)
        return token, full

    monkeypatch.setattr(CausalLM, "draft_tokens_and_probs", wrong)
    monkeypatch.setattr(LLM, "__init__", _with(LLM.__init__, mtp=mtp, draft_vocab_size=3))
    joint = exact_joint(checkpoint.model, SETTINGS["t1"])
    tokens, _ = sample(checkpoint.path, 2, SETTINGS["t1"], seed_offset=2 * NUM_REQUESTS)
    assert min(p_values(tokens, joint).values()) < BAD_P


def _with(init, **extra):
    def patched(self, *args, **kwargs):
        init(self, *args, **{**kwargs, **extra})
        assert self.model.draft_vocab.tolist() == sorted([3, 1, 4, 0, 2, 5][: extra["draft_vocab_size"]])

    return patched


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = write_chat_model(tmp_path_factory.mktemp("chat") / "model")
    vocab = LLM(path, num_speculative_tokens=0, **ENGINE)
    ranking = torch.randperm(vocab.model_config.vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
    # Rank the tokens the model itself emits first, as train-mtp's frequency ranking would.
    emitted = [t for o in vocab.generate(["ROMEO: But soft", "def fib(n):"], SamplingParams(max_tokens=40))
               for t in o.token_ids]
    ranking = list(dict.fromkeys(emitted + ranking))
    return path, mtp_directory(path, path.parent / "mtp", ranking), vocab


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_with_a_sub_vocabulary_equals_k0(chat_model, k):
    path, mtp, plain = chat_model
    prompts = ["ROMEO: But soft", "JULIET: O Romeo", "def fib(n):"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(path, mtp=mtp, num_speculative_tokens=k, draft_vocab_size=48, **ENGINE)
    assert llm.model.draft_vocab.numel() == 48
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == want
    accepted = sum(o.stats.accepted for o in outputs)
    assert accepted > 0  # drafts over the sub-vocabulary are accepted, not only rejected
    drafts = set(llm.engine.state.draft_tokens.flatten().tolist())
    assert drafts <= set(llm.model.draft_vocab.tolist()) | {0}


def test_draft_vocab_size_is_checked(chat_model, tiny_checkpoint):
    path, mtp, _ = chat_model
    vocab_size = LLM(path, mtp=mtp, draft_vocab_size=10**6, **ENGINE).model_config.vocab_size
    assert LLM(path, mtp=mtp, draft_vocab_size=vocab_size, **ENGINE).model.draft_vocab is None  # the full head
    with pytest.raises(CompiledSpecError, match=rf"draft_vocab_size=0 is out of range; allowed 1\.\.{vocab_size}"):
        LLM(path, mtp=mtp, draft_vocab_size=0, **ENGINE)
    with pytest.raises(CompiledSpecError, match="ship a ranked draft vocabulary"):
        LLM(path, draft_vocab_size=16, **ENGINE)  # the checkpoint's own modules have no ranking


@pytest.mark.slow
def test_full_graph_with_a_sub_vocabulary_decodes_as_eager(chat_model):
    """The sub-vocabulary head inside the whole-step graph (an AOTInductor package on CPU) changes nothing, with the
    drafts' weights in float16 (the package then multiplies with half_weight_linear.cpp). Float32 drafts in full are
    in every full row of test_parity_matrix.py."""
    path, mtp, plain = chat_model
    prompts = ["ROMEO: But soft", "def fib(n):"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = dict(mtp=mtp, num_speculative_tokens=2, draft_vocab_size=48, max_seq_len=64, max_batch_size=2,
                  show_progress=False, draft_dtype="float16")
    eager = LLM(path, graph_mode="eager", **engine).generate(prompts, params)
    compiled = LLM(path, graph_mode="full", batch_buckets=(2,), prefill_buckets=(64,), **engine)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        full = compiled.generate(prompts, params)
    kernel_calls = sum(event.name == "compiled_spec_cpu::half_weight_linear" for event in profile.events())
    assert kernel_calls > 0, kernel_calls
    assert [o.token_ids for o in full] == [o.token_ids for o in eager] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.stats.accepted_per_position for o in full] == [o.stats.accepted_per_position for o in eager]
    assert sum(o.stats.accepted for o in full) > 0
