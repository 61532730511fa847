"""Drafts with float16 weights (draft_dtype="float16"): the C++ kernel equals the widened weights' product, the
model stores exactly the drafts' matrices in float16, and decoding stays lossless."""

import pytest
import torch
from torch import nn

from compiled_spec import LLM, CompiledSpecError, SamplingParams
from compiled_spec.model import cpu_kernels
from compiled_spec.model.half_weight_linear import HalfWeightLinear

ENGINE = dict(graph_mode="eager", max_seq_len=64, max_batch_size=4, show_progress=False)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 100])
@pytest.mark.parametrize("out_features, in_features", [(192, 576), (1003, 64), (37, 100)])
def test_kernel_equals_the_product_with_widened_weights(rows, out_features, in_features):
    """Whole blocks of 4 weight rows and a tail, one to four input rows at a time, features that are not whole
    vectors (through ATen), and more rows than the kernel takes (tiles of widened weight rows, the last partial)."""
    assert cpu_kernels.load(), "the kernels must build on a machine with a C++ compiler"
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, 1, in_features, generator=generator)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).half()
    out = torch.ops.compiled_spec_cpu.half_weight_linear(x, weight)
    assert out.shape == (rows, 1, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ weight.float().t(), rtol=1e-5, atol=1e-5)


def test_a_few_rows_take_the_kernel_not_a_widened_copy_of_the_weight():
    """On this machine's ISA the kernel is compiled in: a draft-sized product calls no ATen GEMM (the fallback
    widens the float16 weight and multiplies with aten::mm)."""
    assert cpu_kernels.load()
    x, weight = torch.randn(4, 576), torch.randn(1536, 576).half()
    with torch.profiler.profile() as profiler:
        torch.ops.compiled_spec_cpu.half_weight_linear(x, weight)
    names = {event.key for event in profiler.key_averages()}
    assert "compiled_spec_cpu::half_weight_linear" in names and not names & {"aten::mm", "aten::linear"}, names


def test_kernel_names_bad_input():
    assert cpu_kernels.load()
    x, weight = torch.randn(1, 64), torch.randn(8, 64).half()
    with pytest.raises(RuntimeError, match="x must be float32, got Double"):
        torch.ops.compiled_spec_cpu.half_weight_linear(x.double(), weight)
    with pytest.raises(RuntimeError, match="weight must be a 2-d float16 tensor, got Float"):
        torch.ops.compiled_spec_cpu.half_weight_linear(x, weight.float())
    with pytest.raises(RuntimeError, match="x has 32 features, weight 64"):
        torch.ops.compiled_spec_cpu.half_weight_linear(x[:, :32], weight)


@pytest.fixture(scope="module")
def drafting_model(tmp_path_factory):
    from test_draft_vocab import mtp_directory
    from serving import write_chat_model

    path = write_chat_model(tmp_path_factory.mktemp("half") / "model")
    plain = LLM(path, num_speculative_tokens=0, **ENGINE)
    ranking = list(dict.fromkeys(
        [t for o in plain.generate(["ROMEO: But soft", "def fib(n):"], SamplingParams(max_tokens=40))
         for t in o.token_ids] + list(range(plain.model_config.vocab_size))))
    return path, mtp_directory(path, path.parent / "mtp", ranking), plain


def test_only_the_drafts_matrices_are_float16(drafting_model):
    path, mtp, _ = drafting_model
    model = LLM(path, mtp=mtp, draft_vocab_size=48, draft_dtype="float16", **ENGINE).model
    halves = {name for name, value in model.named_parameters() if value.dtype == torch.float16}
    linears = {f"{name}.weight" for name, part in model.mtp.named_modules(prefix="mtp") if isinstance(part, nn.Linear)}
    drafts = {f"{name}.weight" for name, part in model.mtp.named_modules(prefix="mtp")
              if isinstance(part, HalfWeightLinear)}
    assert linears == set() and drafts and halves == drafts  # every projection of the modules, nothing else
    assert model.draft_head.dtype == torch.float16 and model.embed_tokens.weight.dtype == torch.float32
    reference = LLM(path, mtp=mtp, draft_vocab_size=48, **ENGINE).model
    for name, value in model.named_parameters():
        assert torch.equal(value, dict(reference.named_parameters())[name].to(value.dtype)), name
    with pytest.raises(CompiledSpecError, match=r"draft_dtype='bfloat16' is not supported with dtype='float32'; "
                                                r"choose 'float16' or 'float32'"):
        LLM(path, mtp=mtp, draft_dtype="bfloat16", **ENGINE)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_with_float16_drafts_equals_k0(drafting_model, k):
    path, mtp, plain = drafting_model
    prompts = ["ROMEO: But soft", "JULIET: O Romeo", "def fib(n):"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    outputs = LLM(path, mtp=mtp, num_speculative_tokens=k, draft_vocab_size=48, draft_dtype="float16",
                  **ENGINE).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert sum(o.stats.accepted for o in outputs) > 0
