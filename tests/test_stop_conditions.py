"""Stop conditions: EOS (also inside an accepted draft run), max_tokens, stop strings, max_seq_len."""

import json
import string

import pytest
import torch

from compiled_spec.api import LLM
from compiled_spec.params import SamplingParams

PROMPTS = [[5, 9, 2], [70], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [20, 21, 22, 23, 24, 25, 26], [88, 7]]


def linked_copy(source, target, **files):
    """A model directory with the same weights (linked) and config, plus the given extra files."""
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).symlink_to(item)
    for name, content in files.items():
        (target / name).unlink(missing_ok=True)
        (target / name).write_text(content)
    return target


def generate_chunks(llm, prompts, params):
    """Outputs, and per request the token chunks as streamed (one per prefill or step)."""
    chunks = [[] for _ in prompts]
    outputs = llm.generate(prompts, params, on_tokens=lambda index, tokens: chunks[index].append(list(tokens)))
    return outputs, chunks


@pytest.mark.parametrize("k", [0, 1, 3])
def test_max_tokens_gives_exactly_max_tokens(tiny_checkpoint, k):
    path = tiny_checkpoint("predictive").path
    llm = LLM(path, num_speculative_tokens=k, max_seq_len=40, max_batch_size=4)
    (full,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))
    limits = list(range(1, 10))
    outputs, chunks = generate_chunks(llm, [PROMPTS[0]] * len(limits), [SamplingParams(max_tokens=n, ignore_eos=True) for n in limits])
    for output, limit, streamed in zip(outputs, limits, chunks):
        assert output.finish_reason == "length"
        assert output.token_ids == full.token_ids[:limit]
        assert sum(streamed, []) == output.token_ids
    if k:
        # Some limits fell inside an accepted draft run, which the step had to cut.
        assert any(o.stats.steps and o.stats.accepted + o.stats.steps + 1 > len(o.token_ids) for o in outputs)


@pytest.mark.parametrize("name", ["predictive", "predictive_moe"])
def test_eos_inside_an_accepted_draft_run_ends_the_request_there(tiny_checkpoint, tmp_path, name):
    checkpoint = tiny_checkpoint(name)
    k, prompt, params = 3, PROMPTS[2], SamplingParams(max_tokens=30)
    llm = LLM(checkpoint.path, num_speculative_tokens=k, max_seq_len=48)
    (full,), (chunks,) = generate_chunks(llm, [prompt], [SamplingParams(max_tokens=30, ignore_eos=True)])
    tokens = full.token_ids
    # A token first emitted as an accepted draft that is followed by more tokens of the same step.
    position, eos = next(
        (start + offset, token)
        for start, chunk in zip(_starts(chunks), chunks)
        for offset, token in enumerate(chunk[:-1])
        if start + offset > 0 and token not in tokens[: start + offset]
    )
    config_eos = checkpoint.model.config.eos_token_id
    assert config_eos not in tokens[:position]
    path = linked_copy(checkpoint.path, tmp_path / "eos", **{"generation_config.json": json.dumps({"eos_token_id": eos})})
    llm = LLM(path, num_speculative_tokens=k, max_seq_len=48)
    assert set(llm.eos_ids) == {config_eos, eos}
    (output,), (streamed,) = generate_chunks(llm, [prompt], [params])
    assert output.finish_reason == "stop"
    assert output.token_ids == tokens[: position + 1]
    assert sum(streamed, []) == output.token_ids
    with torch.no_grad():
        expected = checkpoint.model.generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=[config_eos, eos], pad_token_id=eos
        )
    assert expected[0, len(prompt):].tolist() == output.token_ids
    (plain,) = LLM(path, num_speculative_tokens=0, max_seq_len=48).generate([prompt], params)
    assert plain.token_ids == output.token_ids and plain.finish_reason == "stop"


def test_eos_as_the_first_token_ends_the_request_at_prefill(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("predictive")
    prompt = PROMPTS[3]
    (full,) = LLM(checkpoint.path, num_speculative_tokens=2, max_seq_len=40).generate([prompt], SamplingParams(ignore_eos=True))
    eos = full.token_ids[0]
    path = linked_copy(checkpoint.path, tmp_path / "eos", **{"generation_config.json": json.dumps({"eos_token_id": [eos]})})
    (output,) = LLM(path, num_speculative_tokens=2, max_seq_len=40).generate([prompt], SamplingParams())
    assert output.token_ids == [eos] and output.finish_reason == "stop" and output.stats.steps == 0


def _starts(chunks):
    start = 0
    for chunk in chunks:
        yield start
        start += len(chunk)


@pytest.mark.parametrize("k", [0, 3])
def test_max_seq_len_is_never_exceeded(tiny_checkpoint, k):
    max_seq_len = 24
    prompts = [[7] * n for n in (23, 1, 5, 10, 17, 22, 12, 3)]
    llm = LLM(tiny_checkpoint("predictive").path, num_speculative_tokens=k, max_seq_len=max_seq_len, max_batch_size=4)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=100, ignore_eos=True))
    reference = LLM(tiny_checkpoint("predictive").path, num_speculative_tokens=0, max_seq_len=64)
    for prompt, output in zip(prompts, outputs):
        assert output.finish_reason == "length"
        assert len(prompt) + len(output.token_ids) == max_seq_len
        (long,) = reference.generate([prompt], SamplingParams(max_tokens=max_seq_len, ignore_eos=True))
        assert output.token_ids == long.token_ids[: len(output.token_ids)]


def test_finished_request_left_as_a_padding_lane_is_inert(tiny_checkpoint):
    """A request that ends at max_seq_len after accepting drafts holds a length past max_seq_len + 1;
    its slot then runs as a padding lane (batch bucket 2, one active request) and must stay harmless."""
    max_seq_len = 16
    path = tiny_checkpoint("predictive").path
    llm = LLM(path, num_speculative_tokens=3, max_seq_len=max_seq_len, max_batch_size=2, batch_buckets=(2,))
    prompts = [[5, 9], [(7 + 3 * i) % 90 + 2 for i in range(max_seq_len - 5)]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=100, ignore_eos=True))
    assert llm.engine.state.seq_lens[1].item() > max_seq_len + 1
    assert [[0]] == [[index for index, _ in lanes] for lanes in llm.engine.step_log[-1:]]
    plain = LLM(path, num_speculative_tokens=0, max_seq_len=max_seq_len)
    for prompt, output in zip(prompts, outputs):
        assert len(prompt) + len(output.token_ids) == max_seq_len
        assert output.token_ids == plain.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True))[0].token_ids


# Two special tokens and 94 characters: exactly the tiny checkpoints' 96-token vocabulary.
CHARACTERS = string.ascii_letters + string.digits + " \n" + string.punctuation[:30]


@pytest.fixture(scope="module")
def tokenized_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The predictive checkpoint with a character-level tokenizer (token 0 <s>, token 1 </s> = EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
    assert len(vocab) == 96
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    path = linked_copy(tiny_checkpoint("predictive").path, tmp_path_factory.mktemp("tokenized") / "model")
    fast.save_pretrained(path)
    return path


@pytest.mark.parametrize("k", [0, 3])
def test_stop_strings(tokenized_checkpoint, k):
    llm = LLM(tokenized_checkpoint, num_speculative_tokens=k, max_seq_len=48, max_batch_size=2)
    prompt = "Speculate, then verify: "
    (full,) = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    assert full.prompt_token_ids == llm.tokenizer.encode(prompt, add_special_tokens=False)
    text = full.text
    assert len(text) == 20 and text == llm.tokenizer.decode(full.token_ids)
    # Stops that first complete at characters 4 and 9 (every token is one character).
    early, late = text[3:5], text[8:10]
    assert text.find(early) == 3
    late_first = text.find(late)
    cases = [([early], 5, text[:3]), ([late], late_first + 2, text[:late_first]), ([late, early], 5, text[:3])]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, stop=stops) for stops, _, _ in cases]
    outputs, chunks = generate_chunks(llm, [prompt] * len(cases), params)
    for output, streamed, (stops, length, kept) in zip(outputs, chunks, cases):
        assert output.finish_reason == "stop", stops
        assert output.text == kept
        assert output.token_ids == full.token_ids[:length]
        assert sum(streamed, []) == output.token_ids
