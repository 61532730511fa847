"""Structured output (SamplingParams.json_schema) under speculation: the output is masked plain decoding's, at any k.

A six-token vocabulary (", a, b, c and the two specials) keeps every sequence the grammar of a small schema allows
enumerable, so a chi-square test compares a thousand seeded requests of a compiled k=2 engine with the exact masked
distribution, computed from the transformers model and masks written out by hand here (not by xgrammar). A step whose
acceptance test reads the unmasked target at the draft positions must fail the same test. On SmolLM2, twenty schemas
give output that parses and validates, the same text at k = 0, 2 and auto.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

import compiled_spec.speculative.step as step_module
from compiled_spec import LLM, CompiledSpecError, SamplingParams
from compiled_spec.engine.structured_output import Constraint
from compiled_spec.speculative import rng
from compiled_spec.speculative.sampler import race_sample
from compiled_spec.speculative.token_masks import allowed_tokens

QUOTE, A, B, C, BOS, EOS = range(6)
VOCAB = {'"': QUOTE, "a": A, "b": B, "c": C, "<s>": BOS, "</s>": EOS}
SCHEMA = {"type": "string", "pattern": "^[ab]c[ab]*$"}  # c is forced: the host drafts it
PROMPT = [BOS, A, C, B]
GENERATED = 4
NUM_REQUESTS = 1000
GOOD_P, BAD_P = 1e-3, 1e-8
SCHEMAS = Path(__file__).resolve().parents[1] / "compiled_spec" / "benchmarks" / "prompts" / "json_schemas.json"


def allowed_after(tokens: tuple[int, ...]) -> set[int]:
    """What the schema's grammar allows after the generated `tokens`: a JSON string matching [ab]c[ab]*, then EOS."""
    if not tokens:
        return {QUOTE}
    if tokens[-1] == QUOTE and len(tokens) > 1:
        return {EOS}
    return [{A, B}, {C}][len(tokens) - 1] if len(tokens) < 3 else {A, B, QUOTE}


@torch.no_grad()
def exact_joint(model) -> np.ndarray:
    """P(t1..t4 | PROMPT) of masked sampling at temperature 1, as a [6, 6, 6, 6] array."""
    joint = np.zeros((6,) * GENERATED)

    def walk(prefix: tuple[int, ...], probability: float) -> None:
        if len(prefix) == GENERATED:
            joint[prefix] += probability
            return
        logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
        allowed = torch.zeros(6, dtype=torch.bool)
        allowed[list(allowed_after(prefix))] = True
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        for token in allowed.nonzero()[:, 0].tolist():
            walk(prefix + (token,), probability * probs[token].item())

    walk((), 1.0)
    return joint


@pytest.fixture(scope="module")
def grammar_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny_vocab checkpoint with a tokenizer that spells its six tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    source = tiny_checkpoint("tiny_vocab")
    path = tmp_path_factory.mktemp("grammar_vocab") / "model"
    shutil.copytree(source.path, path)
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="</s>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>").save_pretrained(str(path))
    return path, source.model


def sample(path: Path, **engine):
    llm = LLM(path, num_speculative_tokens=2, graph_mode="compile", max_seq_len=12, max_batch_size=256,
              batch_buckets=(256,), structured_output=True, warm_up=False, show_progress=False, **engine)
    params = [SamplingParams(temperature=1.0, max_tokens=GENERATED, seed=i, json_schema=SCHEMA)
              for i in range(NUM_REQUESTS)]
    outputs = llm.generate([PROMPT] * NUM_REQUESTS, params)
    assert llm.engine.runner.mode.value == "compile"
    # A sequence that ends early ended on an EOS the grammar refuses there; padded with EOS it lands in a cell the
    # exact distribution gives 0.
    tokens = np.array([o.token_ids + [EOS] * (GENERATED - len(o.token_ids)) for o in outputs])
    return tokens, outputs


def p_value(tokens: np.ndarray, joint: np.ndarray) -> float:
    """Chi-square p-value of the sampled sequences against their exact distribution; cells expecting < 5 pooled."""
    counts = np.bincount(np.ravel_multi_index(tuple(tokens.T), joint.shape), minlength=joint.size)
    expected = joint.flatten() * len(tokens)
    if counts[expected == 0].any():
        return 0.0  # a sequence the grammar refuses
    large = expected >= 5
    observed, expected_large = counts[large], expected[large]
    pooled = expected[~large].sum()
    if pooled > 0:
        observed, expected_large = np.append(observed, counts[~large].sum()), np.append(expected_large, pooled)
    return stats.chisquare(observed, expected_large / expected_large.sum() * observed.sum()).pvalue


@pytest.mark.slow
def test_compiled_k2_samples_have_the_masked_targets_distribution(grammar_checkpoint):
    path, model = grammar_checkpoint
    joint = exact_joint(model)
    tokens, outputs = sample(path)
    rates = np.mean([o.stats.acceptance_rate_per_position for o in outputs], axis=0)
    assert 0.05 < rates[0] < 0.95, rates  # drafts are both accepted and rejected
    assert p_value(tokens, joint) > GOOD_P
    assert all(len(o.token_ids) == GENERATED and o.text.startswith('"') for o in outputs)


_real_verify = step_module.verify_drafts
_real_mask_logits = step_module.mask_logits
MASKS: dict[str, torch.Tensor] = {}


def _unmasked_step_logits(logits, masks):
    """The step's rows reach verification unmasked (prefill's first token is still masked)."""
    return logits if logits.dim() == 3 else _real_mask_logits(logits, masks)


def _accept_by_unmasked_target(target_probs, draft_probs, draft_tokens, seeds, first_position, draft_counts=None):
    """Wrong: the acceptance test reads the unmasked target at the draft positions; the token after the accepted
    drafts is drawn from the masked target's residual, as it should be."""
    batch, width, vocab = target_probs.shape
    accepted, _ = _real_verify(target_probs, draft_probs, draft_tokens, seeds, first_position, draft_counts)
    masked = target_probs * allowed_tokens(MASKS["state"][:batch, :width], vocab)
    masked = masked / masked.sum(-1, keepdim=True)
    rows = torch.arange(batch)
    p_n = masked[rows, accepted]
    q_n = F.pad(draft_probs, (0, 0, 0, 1))[rows, accepted]
    q_n = torch.where((accepted < draft_counts)[:, None], q_n, 0.0)
    residual = (p_n - q_n).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)
    return accepted, race_sample(residual, rng.stream_key(seeds, first_position + accepted, rng.TARGET))


def _accept_anything(self, tokens):
    for token in tokens:
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            break
    return len(tokens)


@pytest.mark.slow
def test_an_acceptance_test_that_reads_the_unmasked_target_fails_the_same_test(grammar_checkpoint, monkeypatch):
    path, model = grammar_checkpoint
    monkeypatch.setattr(step_module, "mask_logits", _unmasked_step_logits)
    monkeypatch.setattr(step_module, "verify_drafts", _accept_by_unmasked_target)
    made = LLM.__init__

    def keep_masks(self, *args, **kwargs):  # the wrong rule reads the engine's mask tensor
        made(self, *args, **kwargs)
        MASKS["state"] = self.engine.state.token_masks

    monkeypatch.setattr(LLM, "__init__", keep_masks)
    # The host refuses a token outside the grammar (a RuntimeError); here it keeps it, for the test to judge.
    monkeypatch.setattr(Constraint, "accept", _accept_anything)
    tokens, _ = sample(path)
    assert p_value(tokens, exact_joint(model)) < BAD_P


def test_a_schema_needs_an_engine_with_structured_output_and_a_valid_schema(grammar_checkpoint):
    path, _ = grammar_checkpoint
    plain = LLM(path, num_speculative_tokens=2, graph_mode="eager", max_seq_len=12, show_progress=False)
    with pytest.raises(CompiledSpecError, match="structured_output=True") as caught:
        plain.make_request(0, PROMPT, SamplingParams(json_schema=SCHEMA))
    assert caught.value.param == "json_schema"
    llm = LLM(path, num_speculative_tokens=2, graph_mode="eager", max_seq_len=12, show_progress=False,
              structured_output=True)
    with pytest.raises(CompiledSpecError, match="cannot be compiled") as caught:
        llm.make_request(0, PROMPT, SamplingParams(json_schema={"type": "objekt"}))
    assert caught.value.param == "json_schema"
    with pytest.raises(CompiledSpecError, match="json_schema=") as caught:
        SamplingParams(json_schema="{}")
    with pytest.raises(CompiledSpecError, match="draft_tree") as caught:
        LLM(path, draft_tree="2,1", graph_mode="eager", max_seq_len=12, show_progress=False, structured_output=True)
    assert caught.value.param == "structured_output"
    # The grammar ends the request ("stop") at its end, the EOS after the closing quote, even where EOS is ignored.
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, json_schema=SCHEMA, ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids[-2:] == [QUOTE, EOS] and len(out.token_ids) < 10
    assert json.loads(out.text)


def test_forced_tokens_are_drafted_where_the_drafter_has_none(grammar_checkpoint):
    """n-gram drafts on a prompt without c: where the grammar forces c, the n-gram draft (b, after a) is replaced by c
    and accepted; the text is k=0's."""
    path, _ = grammar_checkpoint
    texts = {}
    for k in (0, 2):
        llm = LLM(path, num_speculative_tokens=k, drafter="ngram", graph_mode="eager", max_seq_len=12,
                  show_progress=False, structured_output=True)
        out = llm.generate([[BOS, A, B, A, B]], SamplingParams(max_tokens=6, json_schema=SCHEMA,
                                                              temperature=0.0))[0]
        texts[k] = out.token_ids
    assert texts[0] == texts[2] and texts[2][2] == C
    assert out.stats.drafted >= 1 and out.stats.accepted_per_position[0] >= 1


@pytest.mark.slow
def test_twenty_schemas_give_valid_json_and_the_same_text_at_k0_k2_and_auto():
    """The twenty schemas at k = 0, 2 and auto (per-request k in one engine), in eager."""
    cases = json.loads(SCHEMAS.read_text())
    assert len(cases) == 20
    llm = LLM("smollm2-135m", num_speculative_tokens="auto", max_speculative_tokens=2, graph_mode="eager",
              max_batch_size=8, max_seq_len=192, structured_output=True, show_progress=False)
    conversations = [[{"role": "user", "content": case["prompt"]}] for case in cases]
    texts = {}
    for k in (0, 2, "auto"):
        outputs = llm.chat(conversations, [SamplingParams(max_tokens=140, json_schema=case["schema"],
                                                          num_speculative_tokens=k) for case in cases])
        for case, output in zip(cases, outputs):
            assert output.finish_reason == "stop", output.text
            jsonschema.validate(json.loads(output.text), case["schema"])
        texts[k] = [output.text for output in outputs]
        if k == 2:
            assert sum(o.stats.accepted for o in outputs) > 0
    assert texts[0] == texts[2] == texts["auto"]
    free = llm.chat(conversations[:2], SamplingParams(max_tokens=24))
    assert not any(o.text.startswith("{") for o in free)  # the prompts alone do not give JSON


def test_generate_json_schema_option_from_text_or_file(grammar_checkpoint, tmp_path):
    from click.testing import CliRunner

    from compiled_spec import cli

    path, _ = grammar_checkpoint
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    base = ["generate", "--model", str(path), "--prompt-ids", "4,1,2,1", "-k", "2", "--graph-mode", "eager",
            "--max-seq-len", "12", "--json"]
    records = []
    for schema in (json.dumps(SCHEMA), str(schema_file)):
        result = CliRunner().invoke(cli.main, [*base, "--json-schema", schema], prog_name="compiled-spec")
        assert result.exit_code == 0, result.output
        records.append(json.loads(result.output.splitlines()[0]))
    assert records[0]["token_ids"] == records[1]["token_ids"]
    assert records[0]["token_ids"][:3] in ([QUOTE, A, C], [QUOTE, B, C]) and records[0]["finish_reason"] == "stop"
    bad = CliRunner().invoke(cli.main, [*base, "--json-schema", "[1]"], prog_name="compiled-spec")
    assert bad.exit_code == 2 and "--json-schema" in bad.output and "not a JSON object" in bad.output
