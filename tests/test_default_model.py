"""The embedded default model: transformers loads its base model and agrees with the engine, and it
drafts well enough to be worth speculating with."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compiled_spec import LLM, SamplingParams, SpecStats
from compiled_spec.api import DEFAULT_MODEL

# Opening lines of scenes from the held-out plays (Macbeth, Twelfth Night, Julius Caesar).
HELD_OUT_PROMPTS = [
    "FIRST WITCH.\nWhen shall we three meet again\n",
    "ORSINO.\nIf music be the food of love, play on;\n",
    "FLAVIUS.\nHence! home, you idle creatures, get you home.\n",
    "MACBETH.\nSo foul and fair a day I have not seen.\n",
    "VIOLA.\nWhat country, friends, is this?\n",
    "BRUTUS.\nBe patient till the last.\n",
]


@pytest.fixture(scope="module")
def engine():
    return LLM(num_speculative_tokens=3, graph_mode="eager", max_batch_size=6, max_seq_len=256)


def test_transformers_greedy_equals_the_engine(engine):
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    reference = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    prompts = HELD_OUT_PROMPTS[:3] + ["ROMEO:"]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        expected = reference.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
        assert output.token_ids == expected.tolist()


def test_speculation_pays_off_on_held_out_prompts(engine):
    outputs = engine.generate(HELD_OUT_PROMPTS, SamplingParams(max_tokens=48))
    total = SpecStats(3)
    for output in outputs:
        assert output.text.strip()
        total.merge(output.stats)
    assert total.acceptance_rate_per_position[0] >= 0.6
    assert total.mean_accepted_length >= 2.0


def test_generate_in_eager_prints_text_and_the_stats_line():
    from click.testing import CliRunner

    from compiled_spec.cli import main

    result = CliRunner().invoke(main, ["generate", "ROMEO:", "--max-tokens", "64"])
    assert result.exit_code == 0, result.output
    text, stats = result.stdout.rsplit("stats:", 1)
    assert text.startswith("ROMEO:") and len(text.split()) > 10
    assert "tokens/s" in stats and "acceptance by draft position" in stats and "mean accepted length" in stats
