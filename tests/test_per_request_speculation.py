"""Per-request speculation (SamplingParams.num_speculative_tokens): lanes with different k share one step, and each
request gets the tokens it gets alone. The compiled modes, with such requests among others, are in
test_parity_matrix.py; the server's field and its /metrics are in test_serve.py and test_serve_review.py."""

import re

import pytest

from compiled_spec import LLM, CompiledSpecError, SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
OWN_K = [0, 2, "auto", 1]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("predictive").path, num_speculative_tokens=2, max_batch_size=4, max_seq_len=64,
               show_progress=False)


def params(index: int, k) -> SamplingParams:
    sampled = dict(temperature=0.8, seed=index) if index % 2 else {}
    return SamplingParams(max_tokens=20, ignore_eos=True, num_speculative_tokens=k, **sampled)


def test_lanes_with_their_own_k_share_steps_and_get_what_they_get_alone(llm):
    together = llm.generate(PROMPTS, [params(i, k) for i, k in enumerate(OWN_K)])
    alone = [llm.generate([prompt], [params(i, k)])[0] for i, (prompt, k) in enumerate(zip(PROMPTS, OWN_K))]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.stats.accepted_per_position for o in together] == [o.stats.accepted_per_position for o in alone]
    for output, k in zip(together, OWN_K):
        lane_k = 2 if k == "auto" else k
        assert set(output.stats.steps_per_num_drafts) == {lane_k}
        assert output.stats.verified_per_position[lane_k:] == [0] * (2 - lane_k)
        if lane_k:
            assert output.stats.verified_per_position[lane_k - 1] == output.stats.steps
    assert together[1].stats.accepted > 0  # speculation did happen beside a k=0 lane


def test_a_k_past_the_engines_is_refused_naming_the_range(llm):
    """Reported on its own output, like a bad prompt; the request beside it decodes."""
    bad, good = llm.generate(PROMPTS[:2], [SamplingParams(num_speculative_tokens=3), SamplingParams(max_tokens=4)])
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert re.fullmatch(r"num_speculative_tokens=3 is out of range for this engine; allowed 0\.\.2 \(its most "
                        r"drafts per step\) or 'auto'", bad.error), bad.error
    assert len(good.token_ids) == 4
    with pytest.raises(CompiledSpecError, match="num_speculative_tokens=-1 is invalid"):
        SamplingParams(num_speculative_tokens=-1)
