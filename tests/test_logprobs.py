"""Logprobs under speculation (speculative/logprobs.py): every emitted token's log-probability and top tokens are the
target's log_softmax at its position under teacher forcing, whether the token was an accepted draft (of a chain or a
tree's leaf), a correction or a bonus token, for greedy and sampled requests and any k. The compiled modes are in
test_parity_matrix.py, SmolLM2 against transformers in test_smollm2.py, the server's shapes in test_serve.py."""

import pytest

from compiled_spec import LLM, CompiledSpecError, SamplingParams
from test_auto_k import ScheduledChooser

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
TOP = 5
ENGINES = {
    "k=0": dict(num_speculative_tokens=0),
    "k=2": dict(num_speculative_tokens=2),
    "auto": dict(num_speculative_tokens="auto", max_speculative_tokens=2),
    "tree": dict(draft_tree=(2, 2)),
}


def params(index: int) -> SamplingParams:
    """Request 0 greedy; 1 and 2 sampled with seeds, 2 truncated by top_p (logprobs stay the raw distribution's)."""
    sampled = [{}, dict(temperature=0.9, seed=11), dict(temperature=1.0, top_p=0.7, seed=12)][index]
    return SamplingParams(max_tokens=24, ignore_eos=True, logprobs=TOP, **sampled)


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    results = {}
    for name, drafting in ENGINES.items():
        llm = LLM(path, graph_mode="eager", max_batch_size=3, max_seq_len=64, max_logprobs=TOP, show_progress=False,
                  **drafting)
        if name == "auto":  # chooses by timings, which favour k=0 in eager on so small a model: a fixed schedule
            llm.engine.chooser = ScheduledChooser([1, 2, 0, 2, 2, 1, 0])
        results[name] = (llm, llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))]))
    return results


@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_emitted_tokens_logprob_is_the_targets_log_softmax(outputs, engine):
    llm, results = outputs[engine]
    for prompt, output in zip(PROMPTS, results):
        assert [entry.token_id for entry in output.logprobs] == output.token_ids
        reference = llm.logits(prompt + output.token_ids).float().log_softmax(-1)
        for position, entry in enumerate(output.logprobs, start=len(prompt) - 1):
            assert entry.logprob == pytest.approx(reference[position, entry.token_id].item(), abs=1e-5), position
            top = reference[position].topk(TOP)
            assert [i for i, _ in entry.top_logprobs] == top.indices.tolist()
            assert [v for _, v in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    stats = [output.stats for output in results]
    if engine != "k=0":  # drafts were accepted, so logprobs of accepted drafts and of bonus tokens were checked
        assert sum(s.accepted for s in stats) > 0
    if engine == "tree":  # and of leaves, and of the bonus tokens drawn after one
        assert sum(s.leaf_steps for s in stats) > 0


def test_greedy_logprobs_do_not_depend_on_k(outputs):
    plain = outputs["k=0"][1][0]
    for engine in ENGINES:
        greedy = outputs[engine][1][0]
        assert greedy.token_ids == plain.token_ids, engine
        for entry, want in zip(greedy.logprobs, plain.logprobs, strict=True):
            assert entry.logprob == pytest.approx(want.logprob, abs=1e-5)
            assert [i for i, _ in entry.top_logprobs] == [i for i, _ in want.top_logprobs]
            assert [v for _, v in entry.top_logprobs] == pytest.approx([v for _, v in want.top_logprobs], abs=1e-5)


def test_logprobs_come_only_to_requests_that_ask_and_as_many_as_they_ask(outputs):
    llm, _ = outputs["k=2"]
    none, zero, two = llm.generate(PROMPTS, [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, logprobs=0),
                                             SamplingParams(max_tokens=6, logprobs=2)])
    assert none.logprobs is None
    assert len(zero.logprobs) == len(zero.token_ids) == 6 and all(e.top_logprobs == [] for e in zero.logprobs)
    assert all(len(e.top_logprobs) == 2 for e in two.logprobs)


def test_asking_past_the_engines_max_logprobs_is_an_error_naming_it(outputs, tiny_checkpoint):
    llm, _ = outputs["k=2"]
    bad, good = llm.generate(PROMPTS[:2], [SamplingParams(logprobs=TOP + 1), SamplingParams(max_tokens=3)])
    assert bad.finish_reason == "error" and bad.error == \
        f"logprobs={TOP + 1} is out of range for this engine; allowed 0..{TOP}"
    assert len(good.token_ids) == 3
    off = LLM(tiny_checkpoint("predictive").path, graph_mode="eager", max_seq_len=64, show_progress=False)
    refused = off.generate(PROMPTS[0], SamplingParams(logprobs=0))[0]
    assert refused.error.startswith("logprobs need an engine started with max_logprobs > 0"), refused.error
    assert off.engine.state.step_logprobs is None  # off: the step computes none
    with pytest.raises(CompiledSpecError, match=r"logprobs=21 is invalid; allowed: an integer in 0\.\.20"):
        SamplingParams(logprobs=21)
    with pytest.raises(CompiledSpecError, match=r"max_logprobs=21 is out of range; allowed 0 \(off\)\.\.20"):
        LLM(tiny_checkpoint("predictive").path, graph_mode="eager", max_logprobs=21, show_progress=False)
