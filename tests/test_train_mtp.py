"""`compiled-spec train-mtp` on a tiny base model: the modules learn the base model's own predictions, the run
resumes where it stopped, and the output attaches to the base losslessly with a sub-vocabulary head."""

import json
import re

from click.testing import CliRunner
from safetensors.torch import load_file

from compiled_spec import cli
from compiled_spec import LLM, SamplingParams
from compiled_spec.training.train_mtp import load_config
from serving import write_chat_model

ENGINE = dict(graph_mode="eager", max_seq_len=96, max_batch_size=4, show_progress=False)


def tiny_config(tmp_path, base) -> dict:
    config = load_config(None, {"model": str(base), "work_dir": str(tmp_path / "work"),
                                "output_dir": str(tmp_path / "mtp"), "draft_vocab_size": 96})
    config["corpus"].update(domains=["code", "chat"], code_chars=24000, prompts={"code": 24, "chat": 8},
                            function_prompts=8, later_code_chars=12000, later_code_prompts=4,
                            later_function_prompts=4, fresh_code_prompts=2, fresh_function_prompts=2,
                            prompt_tokens=24, held_out_prompts=4, generate_batch_size=16)
    config["training"].update(num_threads=1, sequence_length=128, batch_size=8, max_steps=40, warmup_steps=4,
                              learning_rate=3e-3, log_every=1, eval_every=20, eval_windows=4, checkpoint_every=10,
                              distill_fraction=0.5)
    return config


def train(config_file, *args):
    result = CliRunner().invoke(cli.main, ["train-mtp", "--config", str(config_file), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_train_mtp_learns_the_base_models_predictions_resumes_and_attaches(tmp_path):
    base = write_chat_model(tmp_path / "base")
    config = tiny_config(tmp_path, base)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config))
    output = train(config_file)
    assert "code: held-out agreement with the base model by depth" in output

    out = tmp_path / "mtp"
    log = json.loads((out / "training_log.json").read_text())
    assert json.loads((out / "mtp_config.json").read_text()) == config
    assert (out / "loss_curve.png").stat().st_size > 0
    first, final = log["history"]["validation"][0], log["final_validation"]
    assert [row["step"] for row in log["history"]["validation"]] == [20, 40]
    # Code: 24 line prompts and 8 ending with a def line, train and held out alike; in training, 4 + 4 more from
    # the modules past code_chars and, three times (the shipped fresh_code_rounds), 2 + 2 fresh draws over all of them.
    assert config["corpus"]["fresh_code_rounds"] == 3
    assert log["train_tokens"] == {"code": (24 + 8 + 4 + 4 + 3 * (2 + 2)) * 128, "chat": 8 * 128}
    assert log["held_out_tokens"] == {"code": (4 + 4) * 128, "chat": 4 * 128}
    train_rows = log["history"]["train"]
    for depth in range(2):
        early = sum(row["loss_per_depth"][depth] for row in train_rows[:3]) / 3
        late = sum(row["loss_per_depth"][depth] for row in train_rows[-3:]) / 3
        assert late < early - 1.0, (depth, early, late)
    for domain in ("code", "chat"):
        assert final["domains"][domain]["agreement_draft_head"][0] > 0.2, final["domains"][domain]
        assert final["domains"][domain]["loss"][0] <= first["domains"][domain]["loss"][0]

    weights = load_file(str(out / "mtp.safetensors"))
    assert {"model.layers.1.eh_proj.weight", "model.layers.2.shared_head.norm.weight"} <= set(weights)

    # Resume: the same run, 4 steps further, continues from step 40.
    train(config_file, "--resume", "--max-steps", "44")
    resumed = json.loads((out / "training_log.json").read_text())
    assert [row["step"] for row in resumed["history"]["train"]][-5:] == [40, 41, 42, 43, 44]

    plain = LLM(base, num_speculative_tokens=0, **ENGINE)
    assert sorted(weights["d2t"].tolist()) == list(range(plain.model_config.vocab_size))  # a ranking of every token
    drafting = LLM(base, mtp=out, num_speculative_tokens=2, **ENGINE)
    assert drafting.model.draft_vocab.numel() == 96
    prompts = ["def fib(n):", "ROMEO: But soft"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    outputs = drafting.generate(prompts, params)
    assert [o.token_ids for o in outputs] == want
    assert sum(o.stats.accepted for o in outputs) > 0


def test_self_generated_windows_read_as_decoding_reads_them_and_resume(tmp_path):
    """Each window is a prompt and the base model's greedy continuation, with the hidden states a teacher-forced pass
    gives, whatever the padding of its batch. Shards of the first prompts are kept: more prompts run the base
    model only on the new ones, and the result equals shards made from scratch. Another base model starts over."""
    import torch

    from compiled_spec.loading.tokenizer import load_tokenizer
    from compiled_spec.training.self_generated import continue_batch, self_generated_windows
    from compiled_spec.training.train_mtp import load_base

    base_dir = write_chat_model(tmp_path / "base")
    base, _ = load_base(base_dir)
    tokenizer = load_tokenizer(base_dir)
    texts = ["def fib(n):", "ROMEO: But soft, what light", "import os", "class Stack:\n    def push(self, item):", "x = 1"]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert len({len(p) for p in prompts}) > 2
    length = 40

    batch = continue_batch(base, prompts, length)
    for row, prompt in enumerate(prompts):
        assert batch["ids"][row, : len(prompt)].tolist() == prompt
        # Past the prompt every token is the base model's greedy choice after the row before it.
        assert torch.equal(batch["ids"][row, len(prompt):], batch["greedy"][row, len(prompt) - 1: -1])
        alone = continue_batch(base, [prompt], length)
        assert torch.equal(alone["ids"][0], batch["ids"][row]) and torch.equal(alone["greedy"][0], batch["greedy"][row])
        teacher = base.model(input_ids=batch["ids"][row: row + 1]).last_hidden_state[0]
        torch.testing.assert_close(batch["hidden"][row], teacher, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(alone["hidden"][0], teacher, rtol=1e-4, atol=1e-4)

    counted = []  # prompts the base model prefilled
    base.model.embed_tokens.register_forward_hook(
        lambda module, args, out: counted.append(args[0].shape[0]) if args[0].shape[1] > 1 else None)
    generation = {"base_model_sha256": "key", "seed": 0, "dtype": "float32"}

    def windows(prompts, length, shards, key="key"):
        data, _ = self_generated_windows(base, prompts, length, 2, shards, "test",
                                         {**generation, "base_model_sha256": key}, 1)
        return data

    shards = tmp_path / "shards"
    windows(prompts[:3], length, shards)
    assert sum(counted) == 3
    grown = windows(prompts, length, shards)
    assert sum(counted) == 6  # only the batches with a new prompt ran: prompts 2 (again) to 4
    fresh = windows(prompts, length, tmp_path / "fresh")
    assert torch.equal(grown["ids"], fresh["ids"]) and torch.equal(grown["greedy"], fresh["greedy"])
    torch.testing.assert_close(grown["hidden"], fresh["hidden"], rtol=1e-5, atol=1e-5)
    assert torch.equal(windows(prompts[:2], length, shards)["ids"], fresh["ids"][:2])
    assert sum(counted) == 11
    # Shorter windows are cut from the longer cached ones, without the base model, and equal generating them.
    shorter = max(len(p) for p in prompts) + 6
    cut = windows(prompts, shorter, shards)
    assert sum(counted) == 11
    fresh_short = windows(prompts, shorter, tmp_path / "fresh_short")
    assert sum(counted) == 16
    assert cut["ids"].shape == (len(prompts), shorter)
    assert torch.equal(cut["ids"], fresh_short["ids"]) and torch.equal(cut["greedy"], fresh_short["greedy"])
    torch.testing.assert_close(cut["hidden"], fresh_short["hidden"], rtol=1e-5, atol=1e-5)
    # The shards still hold the longer windows.
    assert torch.equal(windows(prompts, length, shards)["ids"], fresh["ids"])
    assert sum(counted) == 16
    windows(prompts, length, shards, key="another key")
    assert sum(counted) == 21


def test_function_prompts_end_with_a_def_line_and_grow_stably(tmp_path):
    from compiled_spec.loading.tokenizer import load_tokenizer
    from compiled_spec.training.mtp_corpus import DEF_LINE, code_texts, line_prompts

    def ends_with_a_def_line(ids):
        text = tokenizer.decode(ids)
        return DEF_LINE.fullmatch(text[text.rstrip("\n").rfind("\n") + 1:]) is not None

    tokenizer = load_tokenizer(write_chat_model(tmp_path / "base"))
    train, _ = code_texts(200_000, 10)
    prompts = line_prompts(train, 12, 48, tokenizer, seed=1, ends=DEF_LINE)
    assert len(prompts) == 12 and all(24 <= len(p) <= 48 for p in prompts)
    assert all(ends_with_a_def_line(p) for p in prompts), [tokenizer.decode(p)[-80:] for p in prompts]
    assert line_prompts(train, 5, 48, tokenizer, seed=1, ends=DEF_LINE) == prompts[:5]
    # Without `ends`, prompts end at any line end.
    assert sum(map(ends_with_a_def_line, line_prompts(train, 12, 48, tokenizer, seed=1))) < 6


def test_later_code_prompts_come_after_the_earlier_ones_from_modules_of_their_own(tmp_path):
    from compiled_spec.loading.tokenizer import load_tokenizer
    from compiled_spec.training.mtp_corpus import code_texts
    from compiled_spec.training.train_mtp import domain_prompts

    tokenizer = load_tokenizer(write_chat_model(tmp_path / "base"))
    config = load_config(None, {})
    config["corpus"].update(domains=["code"], code_chars=100_000, prompts={"code": 6}, function_prompts=6,
                            held_out_prompts=2, prompt_tokens=48, later_code_chars=0, fresh_code_prompts=0,
                            fresh_function_prompts=0)
    earlier, earlier_held_out = domain_prompts(config, tokenizer, tmp_path)["code"]
    config["corpus"].update(later_code_chars=100_000, later_code_prompts=8, later_function_prompts=12)
    train, held_out = domain_prompts(config, tokenizer, tmp_path)["code"]
    assert len(earlier) == 12 and train[:12] == earlier and held_out == earlier_held_out
    later = train[12:]
    assert len(later) == 20 and len(set(map(tuple, later))) == 20
    earlier_text = "".join(code_texts(100_000, 10)[0])
    later_texts = [tokenizer.decode(p) for p in later]
    assert all(text.strip() and text not in earlier_text for text in later_texts)
    assert all(text in earlier_text for text in map(tokenizer.decode, earlier))


def test_fresh_code_prompts_come_last_and_repeat_no_earlier_prompt(tmp_path):
    """Fresh draws over every training module (earlier and later) follow all the other code prompts, which stay as
    they were; each is new: no fresh prompt repeats an earlier one (nor, in these draws, another fresh one), and
    the held-out prompts do not change."""
    from compiled_spec.loading.tokenizer import load_tokenizer
    from compiled_spec.training.mtp_corpus import code_texts
    from compiled_spec.training.train_mtp import domain_prompts

    tokenizer = load_tokenizer(write_chat_model(tmp_path / "base"))
    config = load_config(None, {})
    # Few modules and many def-line prompts, so that the earlier draws already repeat and a fresh draw often
    # lands on one of them.
    config["corpus"].update(domains=["code"], code_chars=100_000, prompts={"code": 6}, function_prompts=60,
                            held_out_prompts=2, prompt_tokens=48, later_code_chars=100_000, later_code_prompts=4,
                            later_function_prompts=4, fresh_code_prompts=0, fresh_function_prompts=0,
                            fresh_code_rounds=1)
    earlier, earlier_held_out = domain_prompts(config, tokenizer, tmp_path)["code"]
    assert len(set(map(tuple, earlier))) < len(earlier)
    config["corpus"].update(fresh_code_prompts=10, fresh_function_prompts=10)
    train, held_out = domain_prompts(config, tokenizer, tmp_path)["code"]
    assert train[:len(earlier)] == earlier and held_out == earlier_held_out
    fresh = train[len(earlier):]
    assert len(fresh) == 20 and len(set(map(tuple, fresh))) == 20
    assert not set(map(tuple, fresh)) & set(map(tuple, earlier))
    all_text = "".join(code_texts(200_000, 10)[0])
    fresh_texts = [tokenizer.decode(p) for p in fresh]
    assert all(text in all_text for text in fresh_texts)
    # A prompt short enough may start inside its def line's indentation.
    last_lines = [text[text.rstrip("\n").rfind("\n") + 1:] for text in fresh_texts]
    assert all(re.fullmatch(r" *def \w+\(.*\):\n", line) for line in last_lines[10:])
    assert not all(re.fullmatch(r" *def \w+\(.*\):\n", line) for line in last_lines[:10])
    # A second round of draws comes after the first, which stays as it was, and repeats no prompt before it.
    config["corpus"].update(fresh_code_rounds=2)
    two_rounds = domain_prompts(config, tokenizer, tmp_path)["code"][0]
    assert two_rounds[:len(train)] == train
    second = two_rounds[len(train):]
    assert len(second) == 20 and not set(map(tuple, second)) & set(map(tuple, train))
    # gpu_run's --text-scale 3: every prompt above as it was, then twice the fresh rounds' line-end draws.
    from compiled_spec.training.gpu_run import scaled_config

    scaled = domain_prompts(scaled_config(config, 3), tokenizer, tmp_path)["code"][0]
    assert scaled[:len(two_rounds)] == two_rounds
    extra = scaled[len(two_rounds):]
    assert len(extra) == 2 * 2 * 10 and len(set(map(tuple, extra))) == 40
    assert not set(map(tuple, extra)) & set(map(tuple, two_rounds))


def test_chat_training_prompts_never_name_a_held_out_topic_and_keep_their_order():
    from compiled_spec.training.mtp_corpus import (
        CHAT_TEMPLATES, HELD_OUT_CHAT_TOPICS, LATER_CHAT_TOPICS, MORE_CHAT_TEMPLATES, chat_prompts)

    train, held_out = chat_prompts(held_out=False), chat_prompts(held_out=True)
    assert len(set(train)) == len(train) and not set(train) & set(held_out)
    assert not [p for p in train if any(topic in p for topic in HELD_OUT_CHAT_TOPICS)]
    # Topics added later come after every earlier prompt, so a cache of the earlier answers stays valid.
    later = len(LATER_CHAT_TOPICS) * len(CHAT_TEMPLATES + MORE_CHAT_TEMPLATES)
    assert all(LATER_CHAT_TOPICS[0] not in p for p in train[:-later])
    assert train[-later] == CHAT_TEMPLATES[0].format(topic=LATER_CHAT_TOPICS[0])


def test_decoding_rows_count_a_row_only_where_every_token_it_reads_is_the_base_models_own_choice():
    """Depth m at row i reads the tokens at i+1..i+m: the row counts where each is the greedy token after the row
    before it, as in decoding while drafts are accepted. Rows of a prompt whose next token the base model would not
    have chosen are left out; a loss_rows value other than all or decoding is refused by name."""
    import pytest
    import torch

    from compiled_spec.training.train_mtp import decoding_rows, train_mtp

    # Row:            0  1  2  3  4  5
    ids = torch.tensor([[5, 6, 9, 7, 8, 4]])
    greedy = torch.tensor([[6, 1, 7, 8, 4, 3]])  # tokens 1, 3, 4 and 5 are the greedy choice; token 2 is not
    depth_1, depth_2 = decoding_rows(ids, greedy, 2)
    assert depth_1.tolist() == [[True, False, True, True, True]]
    assert depth_2.tolist() == [[False, False, True, True]]

    config = load_config(None, {"work_dir": "unused", "output_dir": "unused"})
    config["training"]["loss_rows"] = "prompt"
    with pytest.raises(ValueError, match="training.loss_rows is 'prompt'; choose all or decoding"):
        train_mtp(config)
