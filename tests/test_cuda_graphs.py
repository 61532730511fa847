"""On a CUDA machine: real cudagraph-tree replay keeps acceptance and outputs equal to eager.

Run on a GPU box with `python -m pytest -q -m cuda tests/test_cuda_graphs.py`; skipped without one.
Every graph must really be replayed as a CUDA graph (cudagraph_or_error), and nothing recompiles
after warm-up.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from compiled_spec import LLM, SamplingParams

pytestmark = pytest.mark.cuda

K = 2
ENGINE = dict(num_speculative_tokens=K, max_batch_size=4, max_seq_len=64, batch_buckets=(2, 4), prefill_buckets=(64,))
PROMPT_LENGTHS = [3, 17, 5, 9, 30, 1, 12, 7, 22, 4, 15, 2, 26, 8, 11, 6, 19, 13]


def run(llm, prompts):
    llm.engine.step_log.clear()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    return [o.token_ids for o in outputs], list(llm.engine.step_log)


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_cudagraph_replay_keeps_acceptance_parity(tiny_checkpoint, mode):
    checkpoint = tiny_checkpoint("predictive")
    generator = torch.Generator().manual_seed(0)
    vocab = checkpoint.model.config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    eager = run(LLM(checkpoint.path, graph_mode="eager", device="cuda", **ENGINE), prompts)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        llm = LLM(checkpoint.path, graph_mode=mode, device="cuda", show_progress=False, **ENGINE)
        with torch.compiler.set_stance("fail_on_recompile"):
            replayed = run(llm, prompts)
    accepted = {count for step in eager[1] for _, count in step}
    assert {0, 1, K} <= accepted
    assert replayed == eager


def test_the_hisparse_triton_kernel_equals_the_cpu_op():
    from compiled_spec.hisparse.fused import hisparse_attention
    from test_hisparse import tier_case

    for seed in range(6):
        args = tier_case(seed)
        on_gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            gpu = hisparse_attention(*on_gpu)
        cpu = hisparse_attention(*args)
        assert any("_sparse_attention_kernel" in event.key for event in profiler.key_averages())
        torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-5, atol=1e-5)
        for gpu_rows, cpu_rows in zip(gpu[1:3], cpu[1:3]):
            assert torch.equal(gpu_rows[:, :-1].cpu(), cpu_rows[:, :-1])  # the trash row holds anything
        assert torch.equal(gpu[3].cpu(), cpu[3]) and torch.equal(gpu[4].cpu(), cpu[4])


@pytest.mark.parametrize("cold_dtype, cold_pool", [(None, "auto"), ("bfloat16", "auto"), (None, "device")])
def test_hisparse_full_mode_replay_with_a_saturated_hot_buffer_equals_eager(tiny_checkpoint, cold_dtype, cold_pool):
    from test_hisparse import MIRROR_ENGINE, PROMPT_LENGTHS, SATURATED, prompts_for

    path = tiny_checkpoint("predictive").path
    config = dataclasses.replace(SATURATED, cold_dtype=cold_dtype, cold_pool=cold_pool)
    prompts = prompts_for(PROMPT_LENGTHS)
    eager = run(LLM(path, graph_mode="eager", device="cuda", hisparse=config, **MIRROR_ENGINE), prompts)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        llm = LLM(path, graph_mode="full", device="cuda", hisparse=config, show_progress=False, **MIRROR_ENGINE)
        with torch.compiler.set_stance("fail_on_recompile"):
            replayed = run(llm, prompts)
    assert replayed == eager


def test_the_hisparse_cold_pool_is_pinned_host_memory_the_gpu_writes_in_place(tiny_checkpoint):
    from test_hisparse import MIRROR_ENGINE, PROMPT_LENGTHS, SATURATED, prompts_for

    path = tiny_checkpoint("predictive").path

    def engine(cold_pool):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        config = dataclasses.replace(SATURATED, cold_pool=cold_pool)
        llm = LLM(path, graph_mode="eager", device="cuda", hisparse=config, warm_up=False, **MIRROR_ENGINE)
        return llm, torch.cuda.memory_allocated() - before

    on_device, device_bytes = engine("device")
    on_host, host_bytes = engine("auto")
    state = on_host.engine.state
    pool = state.main_keys + state.main_values + state.draft_keys + state.draft_values
    assert all(cache.is_cuda for cache in pool)
    assert device_bytes - host_bytes >= sum(cache.numel() * cache.element_size() for cache in pool)

    prompts = prompts_for(PROMPT_LENGTHS)
    assert run(on_host, prompts) == run(on_device, prompts)
    torch.cuda.synchronize()
    for cache in (state.main_keys[0], state.draft_values[-1]):  # the GPU's writes, read through the host address
        size = cache.numel() * cache.element_size()
        host = torch.frombuffer((ctypes.c_uint8 * size).from_address(cache.data_ptr()), dtype=torch.uint8)
        assert torch.equal(host.view(cache.dtype).view(cache.shape), cache.cpu())
        assert cache.abs().sum() > 0
