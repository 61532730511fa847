"""On CPU, sampling_probs sorts the vocabulary only when a sampled row truncates (top-k / top-p), eagerly and
inside a compiled graph, and gives what the always-sorting computation gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_spec.speculative.sampler import _truncated_probs, sampling_probs

VOCAB = 64
ROWS = 3


def params(temperature=0.0, top_k=0, top_p=1.0, row=None):
    """Per-row (temperature, top_k, top_p); `row` alone gets the given values, the others stay greedy."""
    rows = range(ROWS) if row is None else [row]
    t, k, p = torch.zeros(ROWS), torch.zeros(ROWS, dtype=torch.int64), torch.ones(ROWS)
    for i in rows:
        t[i], k[i], p[i] = temperature, top_k, top_p
    return t, k, p


CASES = {  # name: (parameters, whether the vocabulary is sorted)
    "greedy": (params(), False),
    "greedy rows ignore their top-k and top-p": (params(0.0, 5, 0.5), False),
    "temperature only": (params(0.7), False),
    "top-k at least the vocabulary": (params(0.7, VOCAB + 3), False),
    "one row's top-k": (params(0.7, 5, row=1), True),
    "one row's top-p": (params(1.3, 0, 0.9, row=2), True),
    "top-k and top-p": (params(0.9, 12, 0.8), True),
}


def always_sorting(logits, temperature, top_k, top_p):
    per_row = (ROWS,) + (1,) * (logits.dim() - 1)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).view(per_row)
    probs = _truncated_probs(scaled, top_k.view(per_row), top_p.view(per_row))
    return torch.where((temperature == 0).view(per_row), F.one_hot(logits.argmax(-1), VOCAB).float(), probs)


def sorts(function, *args):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        result = function(*args)
    return result, sum(event.count for event in profiler.key_averages() if event.key == "aten::sort")


@pytest.fixture(scope="module")
def logits():
    return torch.randn(ROWS, 4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("case", CASES)
def test_eager_sorts_only_when_a_sampled_row_truncates(logits, case):
    args, sorted_ = CASES[case]
    probs, count = sorts(sampling_probs, logits, *args)
    assert (count > 0) == sorted_
    assert torch.equal(probs, always_sorting(logits, *args))


def test_the_compiled_graph_branches_on_the_same_rule_without_recompiling(logits):
    compiled = torch.compile(sampling_probs, fullgraph=True, dynamic=False)
    compiled(logits, *params())
    with torch.compiler.set_stance("fail_on_recompile"):
        for case, (args, sorted_) in CASES.items():
            probs, count = sorts(compiled, logits, *args)
            assert (count > 0) == sorted_, case
            torch.testing.assert_close(probs, always_sorting(logits, *args), rtol=1e-6, atol=1e-7, msg=case)
