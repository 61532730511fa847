"""Tokenizers load as AutoTokenizer makes them: for a folder whose config names the generic class, directly (without
AutoTokenizer's model mapping), and the result is the same tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from compiled_spec.api import DEFAULT_MODEL
from compiled_spec.loading.tokenizer import GENERIC_TOKENIZER_CLASSES, load_tokenizer
from serving import write_chat_model

TEXTS = ["ROMEO:\nO, she doth teach the torches to burn bright!", "déjà vu — 東京 🙂\t\n  spaces", ""]


def same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("folder", ["default", "chat"])
def test_a_generic_tokenizer_is_the_one_autotokenizer_makes(folder, tmp_path):
    path = DEFAULT_MODEL if folder == "default" else write_chat_model(tmp_path / "chat")
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] in GENERIC_TOKENIZER_CLASSES
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    same_tokenizer(ours, theirs)
    if folder == "chat":
        conversation = [{"role": "user", "content": "What is the capital of France?"}]
        assert ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
