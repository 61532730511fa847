import json

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from compiled_spec.training.corpus import TEXTS_SUBDIR
from compiled_spec.training.mtp_reference import LlamaWithMtp, build_llama_config
from compiled_spec.training.train import train
from compiled_spec.training.train_tokenizer import train_byte_level_bpe

VERSE = (
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
    "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date.\n"
)
PROSE = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
TINY_MODEL = {
    "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "intermediate_size": 64, "rope_theta": 10000.0, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "initializer_range": 0.02, "num_nextn_predict_layers": 2,
}


def tiny_config(tmp_path, max_steps: int) -> dict:
    texts_dir = tmp_path / "work" / TEXTS_SUBDIR
    texts_dir.mkdir(parents=True)
    (texts_dir / "sonnet_gut.txt").write_text(VERSE * 20)
    (texts_dir / "held_out_gut.txt").write_text((VERSE + PROSE) * 4)
    (texts_dir / "ignored_folio_gut_f.txt").write_text("never read")
    return {
        "seed": 0,
        "work_dir": str(tmp_path / "work"),
        "output_dir": str(tmp_path / "model"),
        "corpus": {"validation_works": ["held_out"]},
        "tokenizer": {"vocab_size": 300},
        "model": TINY_MODEL,
        "training": {
            "num_threads": 1, "sequence_length": 32, "batch_size": 4, "max_steps": max_steps,
            "warmup_steps": 2, "learning_rate": 0.01, "min_learning_rate_ratio": 0.1, "weight_decay": 0.0,
            "adam_betas": [0.9, 0.95], "grad_clip_norm": 1.0, "mtp_loss_weights": [0.5, 0.3],
            "mtp_distill_fraction": 0.5, "log_every": 1, "eval_every": 1000, "eval_windows": 4,
            "checkpoint_every": 10, "midpoint_export_step": 10,
        },
    }


def test_training_lowers_loss_and_exports_a_loadable_model(tmp_path):
    log = train(tiny_config(tmp_path, max_steps=30), resume=False)

    train_rows = log["history"]["train"]
    for depth in range(3):
        first = sum(row["loss_per_depth"][depth] for row in train_rows[:3]) / 3
        last = sum(row["loss_per_depth"][depth] for row in train_rows[-3:]) / 3
        assert last < first - 1.0, (depth, first, last)
    assert set(log["final_validation"]) >= {"loss", "top1_accuracy", "top1_agreement_with_main_greedy"}

    model_dir = tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.decode(tokenizer(VERSE)["input_ids"]) == VERSE
    assert tokenizer.eos_token == "<|endoftext|>"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2
    assert config["eos_token_id"] == tokenizer.eos_token_id

    weights = load_file(str(model_dir / "model.safetensors"))
    first_mtp = TINY_MODEL["num_hidden_layers"]
    for j in range(2):
        for name in ["enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.q_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"]:
            assert f"model.layers.{first_mtp + j}.{name}.weight" in weights
    assert LlamaForCausalLM.from_pretrained(str(model_dir)).config.num_hidden_layers == first_mtp
    assert (model_dir / "loss_curve.png").stat().st_size > 0


def test_resume_continues_from_the_checkpoint(tmp_path):
    config = tiny_config(tmp_path, max_steps=10)
    train(config, resume=False)
    config["training"]["max_steps"] = 12
    log = train(config, resume=True)
    assert [row["step"] for row in log["history"]["train"]][-3:] == [10, 11, 12]


def test_mtp_rows_are_causal():
    tokenizer = train_byte_level_bpe([VERSE * 3], vocab_size=300)
    model = LlamaWithMtp(build_llama_config(TINY_MODEL, len(tokenizer), tokenizer.eos_token_id), 2).eval()
    input_ids = torch.randint(1, len(tokenizer), (1, 24))
    changed = input_ids.clone()
    changed[0, 15] = (changed[0, 15] + 1) % len(tokenizer)
    with torch.no_grad():
        for depth, (before, after) in enumerate(zip(model(input_ids), model(changed))):
            # depth d row i reads tokens up to i + d, so rows before 15 - d cannot see the change
            torch.testing.assert_close(before[:, : 15 - depth], after[:, : 15 - depth])
            assert not torch.allclose(before[:, 15 - depth], after[:, 15 - depth])
