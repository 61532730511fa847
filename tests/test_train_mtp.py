"""`compiled-spec train-mtp` on a tiny base model: the modules learn the base model's own predictions, the run
resumes where it stopped, and the output attaches to the base losslessly with a sub-vocabulary head."""

import json

from click.testing import CliRunner
from safetensors.torch import load_file

import cli
from compiled_spec import LLM, SamplingParams
from compiled_spec.training.train_mtp import load_config
from serving import write_chat_model

ENGINE = dict(graph_mode="eager", max_seq_len=96, max_batch_size=4, show_progress=False)


def tiny_config(tmp_path, base) -> dict:
    config = load_config(None, {"model": str(base), "work_dir": str(tmp_path / "work"),
                                "output_dir": str(tmp_path / "mtp"), "draft_vocab_size": 96})
    config["corpus"].update(domains=["code", "chat"], code_chars=24000, chat_prompts=8, chat_held_out_prompts=4,
                            chat_max_tokens=24, held_out_windows_per_domain=4)
    config["training"].update(num_threads=1, sequence_length=64, batch_size=8, max_steps=40, warmup_steps=4,
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


def test_a_grown_corpus_computes_only_what_is_new(tmp_path):
    """More chat prompts generate only the new answers; more windows run the base model only on the new ones, and
    the result equals a cache made from scratch. A cache made with another base file is not reused."""
    import torch

    from compiled_spec.tokenizer import load_tokenizer
    from compiled_spec.training.mtp_corpus import chat_prompts
    from compiled_spec.training.train_mtp import chat_texts, load_base, teacher_outputs, token_windows

    base_dir = write_chat_model(tmp_path / "base")
    llm = LLM(base_dir, num_speculative_tokens=0, **ENGINE)
    asked = []
    generate = llm.generate
    llm.generate = lambda prompts, params: asked.extend(prompts) or generate(prompts, params)
    prompts = chat_prompts(held_out=False)[:5]
    cache = tmp_path / "chat.json"
    first = chat_texts(llm, prompts[:3], 8, cache, batch_size=2)
    assert len(asked) == 3
    grown = chat_texts(llm, prompts, 8, cache, batch_size=2)
    assert len(asked) == 5 and grown[:3] == first
    assert all(prompt in text for prompt, text in zip(prompts, grown))

    base, _ = load_base(base_dir)
    windows = token_windows(load_tokenizer(base_dir), grown * 4, 32)
    assert len(windows) >= 6
    counted = []  # windows the base model ran on
    base.model.embed_tokens.register_forward_hook(lambda module, args, out: counted.append(args[0].shape[0]))
    teacher_outputs(base, windows[:2], tmp_path / "teacher.pt", "teacher", "key")
    assert sum(counted) == 2
    out = teacher_outputs(base, windows, tmp_path / "teacher.pt", "teacher", "key")
    assert sum(counted) == len(windows)  # only the new windows ran
    fresh = teacher_outputs(base, windows, tmp_path / "fresh.pt", "teacher", "key")
    assert torch.equal(out["ids"], windows) and torch.equal(out["greedy"], fresh["greedy"])
    torch.testing.assert_close(out["hidden"], fresh["hidden"], rtol=1e-5, atol=1e-5)
    teacher_outputs(base, windows, tmp_path / "teacher.pt", "teacher", "another base")
    assert sum(counted) == 3 * len(windows)  # from scratch, then all again for another base
