"""GGUF checkpoints: tiny files written with the gguf writer, checked against transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=...)`) on the same file: logits, greedy text, tokenizer."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import AutoModelForCausalLM, AutoTokenizer

from compiled_spec import LLM, CompiledSpecError, SamplingParams
from compiled_spec.model.packed_linear import weight_format
from tiny_gguf import write_gguf

PROMPTS = ["ROMEO: But soft, what light", "It is the east, and Juliet"]
CASES = [("llama", "F32", False), ("llama", "F16", False), ("llama", "BF16", False), ("llama", "Q8_0", True),
         ("llama", "Q4_0", False), ("llama", "Q4_1", True), ("llama", "Q4_K", False), ("llama", "Q6_K", True),
         ("qwen2", "F32", True), ("qwen2", "Q4_0", False), ("qwen2", "Q4_K", True)]
K_QUANT_HIDDEN_SIZE = 256  # a K-quant block holds 256 values


@pytest.fixture(autouse=True, scope="module")
def tokenizer_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COMPILED_SPEC_CACHE", str(tmp_path_factory.mktemp("compiled_spec_cache")))
        yield


def engine(path) -> LLM:
    return LLM(path, num_speculative_tokens=0, graph_mode="eager", max_seq_len=64, max_batch_size=2,
               show_progress=False)


@pytest.mark.parametrize("architecture, tensor_type, tied", CASES, ids=[f"{a}-{t}" for a, t, _ in CASES])
def test_logits_and_greedy_text_equal_transformers_gguf_loader(tmp_path, architecture, tensor_type, tied):
    """Quantized types run on the packed path (model/packed_linear.py): transformers dequantizes the same file."""
    hidden = K_QUANT_HIDDEN_SIZE if tensor_type.endswith("_K") else 64
    path, _ = write_gguf(tmp_path, architecture, tensor_type, tie_word_embeddings=tied, hidden_size=hidden)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    llm = engine(path)
    assert weight_format(llm.model) == (f"{tensor_type} packed" if tensor_type.startswith("Q") else "float32")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0]
            greedy = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(ids):]
        assert (llm.logits(ids) - want).abs().max().item() <= 1e-4
        assert output.token_ids == greedy.tolist()
        assert output.text == tokenizer.decode(greedy, skip_special_tokens=True)


def test_qwen3_equals_the_model_it_was_written_from(tmp_path):
    # transformers' GGUF loader reads no head_dim for qwen3 (it builds 128-wide heads), so the reference here is
    # the transformers model the file was written from, in F32.
    path, model = write_gguf(tmp_path, "qwen3", "F32")
    llm = engine(path)
    ids = llm.encode(PROMPTS[0])
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    assert (llm.logits(ids) - want).abs().max().item() <= 1e-4


def test_tokenizer_chat_template_and_eos_come_from_the_file_and_are_cached(tmp_path, tmp_path_factory):
    path, _ = write_gguf(tmp_path, "llama", "F32")
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    llm = engine(path)
    text = "ROMEO: But soft, what light through yonder window breaks?\n  JULIET: é ü"
    ids = llm.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert llm.tokenizer.decode(ids) == reference.decode(ids) == text
    assert llm.tokenizer.chat_template == reference.chat_template
    assert llm.eos_ids == (reference.eos_token_id,)
    again = engine(path)  # built from the cached folder this time
    assert again.encode(text) == ids and again.tokenizer.chat_template == reference.chat_template
    assert llm.chat([{"role": "user", "content": "Who?"}], SamplingParams(max_tokens=3))[0].prompt_token_ids == \
        reference.encode("<|user|>Who?\n<|assistant|>", add_special_tokens=False)


def test_a_truncated_file_is_named(tmp_path):
    path, _ = write_gguf(tmp_path, "llama", "Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CompiledSpecError, match="model.gguf.*truncated or corrupt"):
        engine(path)


def minimal_gguf(path, architecture: str, tensor_type=GGMLQuantizationType.F32):
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    data = torch.zeros(64, 32 * 22 // 32, dtype=torch.uint8).numpy()  # Q5_0: 22 bytes per 32 values
    if tensor_type == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", torch.zeros(64, 32).numpy())
    else:
        writer.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unknown_architecture_and_an_unsupported_type_are_named(tmp_path):
    minimal_gguf(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(CompiledSpecError, match=r"unsupported GGUF architecture 'mamba'; supported: llama, qwen2"):
        engine(tmp_path / "mamba.gguf")
    minimal_gguf(tmp_path / "q5.gguf", "llama", GGMLQuantizationType.Q5_0)
    with pytest.raises(CompiledSpecError, match=r"token_embd.weight has quantization type Q5_0, which is not "
                                                r"supported; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"):
        engine(tmp_path / "q5.gguf")
    with pytest.raises(CompiledSpecError, match="does not exist"):
        engine(tmp_path / "missing.gguf")


@pytest.mark.parametrize("head_count, message", [
    (None, r"metadata llama\.attention\.head_count is missing; allowed: a positive integer"),
    (0, r"metadata llama\.attention\.head_count is 0; allowed: a positive integer"),
    (3, r"metadata llama\.attention\.head_count_kv is 2; allowed: a positive divisor of "
        r"llama\.attention\.head_count \(3\)"),
    (64, r"blk\.0\.attn_q\.weight has 64 rows, which metadata llama\.attention\.head_count \(64\) does not split "
         r"into whole heads; allowed: a head count dividing 32"),
])
def test_a_bad_head_count_is_named_and_the_cli_exits_2(tmp_path, head_count, message):
    path, _ = write_gguf(tmp_path, "llama", head_count=head_count)
    with pytest.raises(CompiledSpecError, match=message):
        engine(path)
    result = subprocess.run([sys.executable, "-m", "compiled_spec.cli", "generate", "--model", str(path), "ROMEO:"],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert re.search(message, result.stderr), result.stderr
