"""The evaluation command's metrics, on a tiny checkpoint whose MTP modules mimic the main model."""

import pytest
import torch
import torch.nn.functional as F

from compiled_spec import LLM
from compiled_spec.training.evaluate import acceptance, evenly_spaced_windows, teacher_forced_metrics


def test_teacher_forced_metrics_match_transformers(tiny_checkpoint):
    checkpoint = tiny_checkpoint("predictive")
    windows = evenly_spaced_windows(list(range(2, 90)), count=3, length=20)
    assert [len(w) for w in windows] == [20, 20, 20]
    llm = LLM(checkpoint.path, num_speculative_tokens=0, max_seq_len=32)
    metrics = teacher_forced_metrics(llm, windows)

    ids = torch.tensor(windows)
    logits = checkpoint.model(ids).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert abs(metrics["validation_cross_entropy"] - expected.item()) < 1e-4
    assert len(metrics["mtp_top1_accuracy"]) == 2
    # Mimicking modules agree with the main model far more often than chance (1/96).
    assert min(metrics["mtp_top1_agreement_with_main"]) > 0.2


def test_acceptance_reports_every_draft_position(tiny_checkpoint):
    path = tiny_checkpoint("predictive").path
    result = acceptance(path, [[5, 6, 7], [9, 10]], k=2, max_tokens=12, graph_mode="eager", max_seq_len=64)
    assert result["k"] == 2 and result["steps"] > 0
    rates = result["acceptance_rate_per_position"]
    assert len(rates) == 2 and rates[0] >= rates[1]
    assert 1.0 <= result["mean_accepted_length"] <= 3.0
    assert abs(result["mean_accepted_length"] - (1 + sum(rates))) < 1e-9


def test_acceptance_files_gain_shapes_measured_with_the_same_settings_and_refuse_others():
    from compiled_spec.training.mtp_acceptance import merged

    settings = dict(model="m", mtp="dir", max_tokens=64, prompts_per_domain=32, greedy=True, draft_dtype="float16")
    earlier = dict(settings, by_draft_vocab_size={"8192": {"chain k=2": {"mixed": 2.0}, "tree 2,1": {"mixed": 2.1}}})
    later = dict(settings, by_draft_vocab_size={"8192": {"tree 2,1": {"mixed": 2.2}, "tree 4,2,2": {"mixed": 2.6}},
                                                "4096": {"chain k=2": {"mixed": 1.9}}})
    assert merged(earlier, later)["by_draft_vocab_size"] == {
        "8192": {"chain k=2": {"mixed": 2.0}, "tree 2,1": {"mixed": 2.2}, "tree 4,2,2": {"mixed": 2.6}},
        "4096": {"chain k=2": {"mixed": 1.9}},
    }
    assert earlier["by_draft_vocab_size"]["8192"]["tree 2,1"] == {"mixed": 2.1}  # the earlier file's dict is kept
    with pytest.raises(ValueError, match=r"other settings \(max_tokens: 64 there, 128 here\); give another --json file"):
        merged(earlier, dict(later, max_tokens=128))
