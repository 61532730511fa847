"""The incremental detokenizer against full decoding on real tokenizers: after every token its text is what
tokenizer.decode gives for all tokens so far, stop strings are found at the same token as by decoding the whole
output after every token, and the stream shows the same pieces of text as decoding the whole output per chunk did."""

import random
from pathlib import Path

import pytest

from compiled_spec.detokenizer import IncrementalDetokenizer, TextStream, held_back
from compiled_spec.loading.registry import model_path
from compiled_spec.loading.tokenizer import gguf_tokenizer, load_tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "compiled_spec" / "default_model"
TEXTS = [
    "Hello, world! The café serves crème brûlée at 9 €.",
    "Emoji: 🤖👍🏽 and a family 👨‍👩‍👧 then 🎉🎉🎉 done.",
    "日本語のテキストと中文字符，混合 English words.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # é ß ø\n\n",
    "Ünïcödé çömbïnïng: e\u0301 a\u0308 \u00e5 — “quotes” ‘single’ … ✓✗ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer: a token's leading space is dropped when it is decoded first, so a token
    decodes right only with the tokens before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


def tokenizers():
    found = [pytest.param(load_tokenizer(Path(DEFAULT_MODEL)), id="default_model"),
             pytest.param(metaspace_tokenizer(), id="metaspace")]
    smollm2 = model_path("smollm2-135m")
    if smollm2.is_file():
        found.append(pytest.param(gguf_tokenizer(smollm2), id="smollm2"))
    return found


def decode(tokenizer, token_ids):
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def stop_by_full_decode(tokenizer, token_ids, stops):
    """What the engine did before the incremental detokenizer: decode everything after each token. Returns the
    number of tokens kept and the text cut at the first stop string, or None when no stop string appears."""
    for end in range(1, len(token_ids) + 1):
        text = decode(tokenizer, token_ids[:end])
        cuts = [text.find(stop) for stop in stops if stop in text]
        if cuts:
            return end, text[:min(cuts)]
    return None


def stream_by_full_decode(tokenizer, chunks, stops, final_text):
    """The server's stream before the incremental detokenizer: the whole text decoded per chunk."""
    token_ids, shown, pieces = [], 0, []
    for chunk in chunks:
        token_ids += chunk
        text = decode(tokenizer, token_ids)
        safe = len(text.rstrip("\ufffd"))
        cuts = [text.find(stop) for stop in stops if stop in text]
        safe = min(safe, *cuts) if cuts else min(safe, len(text) - held_back(text, stops))
        if safe > shown:
            pieces.append(text[shown:safe])
            shown = safe
    pieces.append(final_text[shown:])
    return pieces


def token_ids_of(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(params=tokenizers())
def tokenizer(request):
    return request.param


@pytest.mark.parametrize("text", TEXTS)
def test_text_after_every_token_is_the_full_decode(tokenizer, text):
    token_ids = token_ids_of(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    unfinished = 0
    for end, token in enumerate(token_ids, 1):
        detokenizer.add(token)
        expected = decode(tokenizer, token_ids[:end])
        assert detokenizer.full_text == expected
        assert not detokenizer.text.endswith("\ufffd")
        unfinished += expected.endswith("\ufffd")
    assert detokenizer.text == text
    if "🤖" in text and tokenizer.vocab_size > 10_000:
        assert unfinished, "the text should split a multi-byte character across tokens"


def stop_cases(tokenizer, seed=0):
    """Stop strings cut from the texts at random places, so many span token boundaries and multi-byte characters."""
    rng = random.Random(seed)
    cases = []
    for text in TEXTS:
        token_ids = token_ids_of(tokenizer, text)
        for _ in range(12):
            start = rng.randrange(len(text) - 1)
            stop = text[start:start + rng.randint(1, 6)]
            decoy = text[rng.randrange(len(text)):][:3] + "\u2603"  # never appears
            cases.append((token_ids, [decoy, stop]))
        cases.append((token_ids, ["\u2603 absent"]))
    return cases


def test_stop_strings_end_the_text_at_the_same_token_as_full_decoding(tokenizer):
    spanning = 0
    for token_ids, stops in stop_cases(tokenizer):
        expected = stop_by_full_decode(tokenizer, token_ids, stops)
        detokenizer = IncrementalDetokenizer(tokenizer, stops)
        got = None
        for end, token in enumerate(token_ids, 1):
            if detokenizer.add(token):
                got = end, detokenizer.full_text[:detokenizer.stop_at]
                break
        assert got == expected, (stops, token_ids)
        if expected is not None:
            kept_text = decode(tokenizer, token_ids[:expected[0] - 1])
            spanning += not any(stop in kept_text + decode(tokenizer, token_ids[expected[0] - 1:expected[0]])
                                for stop in stops)
    assert spanning, "some stop string should only appear once two tokens' text is joined"


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_streamed_text_is_what_full_decoding_streamed(tokenizer, chunk_size):
    for token_ids, stops in stop_cases(tokenizer, seed=1):
        stopped = stop_by_full_decode(tokenizer, token_ids, stops)
        kept = token_ids[:stopped[0]] if stopped else token_ids
        final_text = stopped[1] if stopped else decode(tokenizer, kept)
        chunks = [kept[i:i + chunk_size] for i in range(0, len(kept), chunk_size)]
        stream = TextStream(tokenizer, stops)
        pieces = [stream.add(chunk) for chunk in chunks] + [stream.finish(final_text)]
        assert [p for p in pieces if p] == [p for p in stream_by_full_decode(tokenizer, chunks, stops, final_text) if p]
        if not stopped:
            assert "".join(pieces) == final_text


def test_decoding_is_linear_in_the_output(tokenizer):
    """Each token is decoded in a window of a few tokens, not with the whole output."""
    token_ids = token_ids_of(tokenizer, " ".join(TEXTS) * 4)
    widths = []

    class Counting:
        def decode(self, ids, **kwargs):
            widths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    detokenizer = IncrementalDetokenizer(Counting(), ["\u2603"])
    for token in token_ids:
        detokenizer.add(token)
    assert detokenizer.full_text == decode(tokenizer, token_ids)
    assert max(widths) <= 8 and sum(widths) <= 8 * len(token_ids)
