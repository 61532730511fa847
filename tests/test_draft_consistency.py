"""After every prefill and step, the drafts the engine holds are what transformers' MtpLayer modules would
draft on the committed sequence: proof that the draft-extend pass leaves every MTP KV cache as if it had
been computed from verified tokens and hidden states only."""

import pytest
import torch

import compiled_spec.engine.engine as engine_module
from compiled_spec.api import LLM
from compiled_spec.params import SamplingParams
from hf_reference import mtp_logits_per_depth

PROMPTS = [[5, 9, 2], [70], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [20, 21, 22, 23, 24, 25, 26], [88, 7]]
MAX_TOKENS = [4, 24, 14, 20, 12]  # the first ends first; the second moves into its slot


def reference_drafts(checkpoint, committed: list[int], drafts: list[int], k: int) -> list[torch.Tensor]:
    """MTP logits that produce draft m (m = 1..k) for committed tokens t_0..t_{L-1}.

    Draft m predicts t_{L+m-1}: depth m at row L-2, which sees t_{L-1} and drafts d_1..d_{m-1}.
    """
    extended = committed + drafts[: k - 1]
    per_depth = mtp_logits_per_depth(checkpoint.model, checkpoint.mtp_layers, extended, k)
    return [per_depth[m][len(committed) - 2] for m in range(k)]


@pytest.mark.parametrize(
    "name,k,temperature",
    [
        ("predictive", 1, 0.0),
        ("predictive", 2, 0.0),
        ("predictive", 3, 0.0),  # depth 3 reuses the second (last) module
        ("predictive", 3, 1.0),
        ("predictive_moe", 2, 0.0),
        ("predictive_moe", 3, 1.0),
    ],
)
def test_held_drafts_match_transformers_mtp(tiny_checkpoint, monkeypatch, name, k, temperature):
    checkpoint = tiny_checkpoint(name)
    moves = []
    move_slot = engine_module.move_slot
    monkeypatch.setattr(engine_module, "move_slot", lambda state, source, target: (moves.append(source), move_slot(state, source, target)))
    llm = LLM(checkpoint.path, num_speculative_tokens=k, max_seq_len=40, max_batch_size=2)
    engine, state = llm.engine, llm.engine.state
    checked = []

    def check(request_index: int, new_tokens: list[int]) -> None:
        slot = next(s for s, request in enumerate(engine.slots) if request.index == request_index)
        if state.done[slot]:
            return
        request = engine.slots[slot]
        committed = request.prompt_ids + request.output.token_ids
        assert state.seq_lens[slot].item() == len(committed)
        assert state.pending_tokens[slot].item() == committed[-1]
        drafts = state.draft_tokens[slot].tolist()
        expected = reference_drafts(checkpoint, committed, drafts, k)
        for depth, logits in enumerate(expected, start=1):
            where = (name, k, request_index, len(committed), depth)
            if temperature == 0:
                assert drafts[depth - 1] == logits.argmax().item(), where
            else:
                want = (logits / temperature).softmax(-1)
                assert torch.allclose(state.draft_probs[slot, depth - 1], want, atol=1e-5), where
        checked.append(len(committed))

    params = [SamplingParams(max_tokens=n, temperature=temperature, seed=i, ignore_eos=True) for i, n in enumerate(MAX_TOKENS)]
    outputs = llm.generate(PROMPTS, params, on_tokens=check)
    assert [len(o.token_ids) for o in outputs] == MAX_TOKENS
    accepted = [count for lanes in engine.step_log for _, count in lanes]
    # Checked after prefill and after steps that accepted none and all drafts, with requests moved between slots.
    assert len(checked) >= 20 and 0 in accepted and k in accepted, accepted
    assert moves
