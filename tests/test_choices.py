"""n > 1 (SamplingParams.n): independent choices of one prompt share its prefill (one main-model pass, its KV rows
copied into n slots) and decode in n slots; with a seed, choice i equals a request of its own with seed + i. The
compiled modes are in test_parity_matrix.py, the server's shapes in test_serve.py."""

import pytest

from compiled_spec import LLM, CompiledSpecError, SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def sampled(seed: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=20, ignore_eos=True, **extra)


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_each_choice_equals_a_request_with_its_seed_and_the_prefill_runs_once(tiny_checkpoint, drafter):
    """Three prompts of 3, 1 and 2 choices on 4 slots: the third waits for two free slots."""
    llm = LLM(tiny_checkpoint("predictive").path, graph_mode="eager", num_speculative_tokens=2, max_batch_size=4,
              max_seq_len=64, drafter=drafter, max_logprobs=2, show_progress=False)
    params = [sampled(40, n=3, logprobs=2), sampled(50), sampled(60, n=2)]
    before = llm.engine.prefills
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.prefills - before == 3  # one main-model pass per prompt, whatever its n
    assert [len(output.choices or [output]) for output in outputs] == [3, 1, 2]
    alone = {}
    for prompt, output, seed in zip(PROMPTS, outputs, (40, 50, 60)):
        assert output.choices is None or output.choices[0] is output
        for index, choice in enumerate(output.choices or [output]):
            single = llm.generate([prompt], sampled(seed + index, logprobs=2 if seed == 40 else None))[0]
            assert choice.index == index
            assert choice.token_ids == single.token_ids, (seed, index)
            assert choice.stats.accepted_per_position == single.stats.accepted_per_position
            alone[seed, index] = single
    assert len({tuple(choice.token_ids) for choice in outputs[0].choices}) > 1  # independent choices
    for choice in outputs[0].choices:
        single = alone[40, choice.index]
        for entry, want in zip(choice.logprobs, single.logprobs, strict=True):
            assert [i for i, _ in entry.top_logprobs] == [i for i, _ in want.top_logprobs]
            assert entry.logprob == pytest.approx(want.logprob, abs=1e-5)
    stats = [choice.stats for output in outputs for choice in output.choices or [output]]
    # Drafts were made from each choice's own state (n-gram drafts of a random model are rarely accepted)
    assert sum(s.accepted if drafter == "mtp" else s.drafted for s in stats) > 0


def test_n_past_the_slots_is_an_error_naming_the_range(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("predictive").path, graph_mode="eager", num_speculative_tokens=2, max_batch_size=2,
              max_seq_len=64, show_progress=False)
    bad, good = llm.generate(PROMPTS[:2], [SamplingParams(n=3), SamplingParams(max_tokens=3, n=2)])
    assert bad.finish_reason == "error" and bad.error == \
        "n=3 is out of range for this engine; allowed 1..2 (its max_batch_size: each choice takes a slot)"
    assert [len(choice.token_ids) for choice in good.choices] == [3, 3]
    with pytest.raises(CompiledSpecError, match=r"n=0 is invalid; allowed: an integer in 1\.\.256"):
        SamplingParams(n=0)
