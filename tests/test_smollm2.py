"""The one real-model test: SmolLM2-135M-Instruct's GGUF (Q4_1), fetched as a user fetches it, against
transformers' GGUF loader on the same file: logits, logprobs, the tokenizer, and greedy text, decoded with the MTP
modules shipped for it (their default k=2, 8192-token draft head and, on CPU, float16 draft weights), whose
drafts must be accepted above a floor. The file's matrices stay packed (Q4_1 layers, the Q8_0 tied head) and are
multiplied by the weight-only kernel (model/packed_linear.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compiled_spec import LLM, SamplingParams, fetch_model
from compiled_spec.model.packed_linear import PackedEmbedding, weight_format

from compiled_spec.loading.registry import SHIPPED_MTP_ROOT

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Code nobody trained the modules on (not from the standard library).
CODE = 'def binary_search(items, target):\n    """Return the index of target in the sorted list items, or -1."""\n'
CODE_POSITION_1_FLOOR = 0.3  # measured 0.43 with the first modules; modules with random weights get 0


@pytest.fixture(scope="module")
def smollm2():
    path = fetch_model("smollm2-135m")
    llm = LLM("smollm2-135m", graph_mode="eager", max_seq_len=128, max_batch_size=1, max_logprobs=5,
              show_progress=False)
    return path, llm


def test_smollm2_gguf_equals_transformers(smollm2):
    path, llm = smollm2
    assert llm.path == path and llm.mtp_path == SHIPPED_MTP_ROOT / "smollm2-135m"
    assert llm.num_speculative_tokens == 2 and llm.model.draft_vocab.numel() == 8192
    assert llm.model.draft_head.dtype == llm.model.mtp[0].eh_proj.weight.dtype == torch.float16
    assert weight_format(llm.model) == "Q4_1+Q8_0 packed" and isinstance(llm.model.embed_tokens, PackedEmbedding)
    config = llm.model_config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.tie_word_embeddings) == \
        (30, 576, 49152, True)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    output = llm.chat(MESSAGES, SamplingParams(max_tokens=16))[0]
    assert output.prompt_token_ids == ids
    code_ids = llm.encode(CODE)
    code_output = llm.generate(CODE, SamplingParams(max_tokens=48, ignore_eos=True, logprobs=5))[0]
    with torch.no_grad():
        want = reference.eval()(torch.tensor([ids])).logits[0]
        greedy = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        code_greedy = reference.generate(torch.tensor([code_ids]), max_new_tokens=48, do_sample=False,
                                         eos_token_id=None)[0, len(code_ids):].tolist()
        code_logprobs = reference(torch.tensor([code_ids + code_greedy])).logits[0].log_softmax(-1)
    assert (llm.logits(ids) - want).abs().max().item() <= 1e-4
    assert output.token_ids == greedy[: len(output.token_ids)]
    assert code_output.token_ids == code_greedy  # speculative greedy output is transformers' greedy output
    # Each emitted token's logprob, accepted draft or not, is transformers' log_softmax at its position.
    for position, entry in enumerate(code_output.logprobs, start=len(code_ids) - 1):
        assert entry.logprob == pytest.approx(code_logprobs[position, entry.token_id].item(), abs=1e-4)
        top = code_logprobs[position].topk(5)
        assert [i for i, _ in entry.top_logprobs] == top.indices.tolist()
        assert [v for _, v in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert code_output.stats.acceptance_rate_per_position[0] >= CODE_POSITION_1_FLOOR, code_output.stats
    assert output.finish_reason == "stop" and output.token_ids[-1] in llm.eos_ids
    assert "Paris" in output.text
    code = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # é"
    assert llm.encode(code) == tokenizer.encode(code, add_special_tokens=False)
    assert llm.tokenizer.decode(llm.encode(code)) == code


def test_speculative_greedy_on_packed_weights_equals_k0_for_every_k(smollm2):
    """An engine per k (k is fixed when the engine is built): each drafts and verifies, and emits k=0's tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5)
    outputs, logprobs = {}, {}
    for k in (0, 1, 2, 3, "auto"):
        llm = LLM("smollm2-135m", num_speculative_tokens=k, graph_mode="eager", max_seq_len=128, max_batch_size=1,
                  max_logprobs=5, show_progress=False)
        output = llm.generate(CODE, params)[0]
        assert llm.draft_slots == (3 if k == "auto" else k)
        assert (sum(output.stats.verified_per_position) > 0) == (k != 0), (k, output.stats)
        outputs[k] = output.token_ids
        logprobs[k] = output.logprobs
        del llm
    assert all(tokens == outputs[0] for tokens in outputs.values()), outputs
    for k, entries in logprobs.items():  # the same logprobs and top 5 whatever the drafts were
        for entry, plain in zip(entries, logprobs[0], strict=True):
            assert entry.logprob == pytest.approx(plain.logprob, abs=1e-5), k
            assert [v for _, v in entry.top_logprobs] == pytest.approx([v for _, v in plain.top_logprobs], abs=1e-5)
