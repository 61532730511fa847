"""The one real-model test: SmolLM2-135M-Instruct's GGUF (Q4_1), fetched as a user fetches it, against
transformers' GGUF loader on the same file: logits, greedy text and the tokenizer."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compiled_spec import LLM, SamplingParams, fetch_model

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    path = fetch_model("smollm2-135m")
    llm = LLM("smollm2-135m", graph_mode="eager", max_seq_len=128, max_batch_size=1, show_progress=False)
    return path, llm


def test_smollm2_gguf_equals_transformers(smollm2):
    path, llm = smollm2
    assert llm.path == path and llm.num_speculative_tokens == 0  # no MTP modules shipped yet
    config = llm.model_config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.tie_word_embeddings) == \
        (30, 576, 49152, True)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    output = llm.chat(MESSAGES, SamplingParams(max_tokens=16))[0]
    assert output.prompt_token_ids == ids
    with torch.no_grad():
        want = reference.eval()(torch.tensor([ids])).logits[0]
        greedy = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert (llm.logits(ids) - want).abs().max().item() <= 1e-4
    assert output.token_ids == greedy[: len(output.token_ids)]
    assert output.finish_reason == "stop" and output.token_ids[-1] in llm.eos_ids
    assert "Paris" in output.text
    code = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # é"
    assert llm.encode(code) == tokenizer.encode(code, add_special_tokens=False)
    assert llm.tokenizer.decode(llm.encode(code)) == code
