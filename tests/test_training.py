import json
import resource
import subprocess
import sys

import pytest
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


class Stopped(Exception):
    pass


def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one_bitwise(tmp_path, monkeypatch):
    """12 steps in one go, and 10 steps, a stop right after the step-10 checkpoint, and 2 resumed steps: the same
    weights and the same losses at every step, bit for bit (RNGs, batch order and optimizer state all resume)."""
    from compiled_spec.training import loop

    whole = train(tiny_config(tmp_path / "whole", max_steps=12), resume=False)
    save_checkpoint = loop.save_checkpoint

    def save_then_stop(path, model, optimizer, step, generator, log):
        save_checkpoint(path, model, optimizer, step, generator, log)
        if step == 10:
            raise Stopped()

    config = tiny_config(tmp_path / "stopped", max_steps=12)
    with monkeypatch.context() as patch:
        patch.setattr(loop, "save_checkpoint", save_then_stop)
        with pytest.raises(Stopped):
            train(config, resume=False)
    resumed = train(config, resume=True)

    def losses(log):
        return [(row["step"], row["loss"], row["loss_per_depth"]) for row in log["history"]["train"]]

    assert [step for step, _, _ in losses(resumed)] == list(range(1, 13))
    assert losses(resumed) == losses(whole)
    weights = [load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("whole", "stopped")]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    checkpoints = [torch.load(tmp_path / run / "work" / loop.CHECKPOINT_NAME, weights_only=True)
                   for run in ("whole", "stopped")]
    for name, tensor in checkpoints[0]["model"].items():
        assert torch.equal(tensor, checkpoints[1]["model"][name]), name


class RunsCode:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_a_checkpoint_that_would_run_code_is_not_loaded(tmp_path, capsys):
    from compiled_spec.errors import CompiledSpecError
    from compiled_spec.training import loop

    config = tiny_config(tmp_path, max_steps=2)
    torch.save({"model": {}, "step": 1, "payload": RunsCode()}, tmp_path / "work" / loop.CHECKPOINT_NAME)
    with pytest.raises(CompiledSpecError, match=r"checkpoint\.pt holds more than tensors and plain data"):
        train(config, resume=True)
    assert "unpickled code ran" not in capsys.readouterr().out


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


FAULTS_PER_ROUND = """
import ctypes, resource, sys, tempfile
from compiled_spec.training import loop
if sys.argv[1] == "training":
    work = tempfile.mkdtemp()
    loop.prepare({"seed": 0, "training": {"num_threads": 1}, "work_dir": work, "output_dir": work})
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size, faults = 96 << 20, []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_training_keeps_large_freed_blocks_instead_of_faulting_them_back_in():
    def faults_per_round(mode):
        out = subprocess.run([sys.executable, "-c", FAULTS_PER_ROUND, mode], capture_output=True, text=True, check=True)
        return [int(n) for n in out.stdout.split()]

    pages = (96 << 20) // resource.getpagesize()
    default, kept = faults_per_round("default"), faults_per_round("training")
    # glibc's default maps a block this large afresh each time; kept, only the first round touches new pages.
    assert all(n > pages * 0.9 for n in default), default
    assert kept[0] > pages * 0.9 and max(kept[1:]) < pages * 0.01, kept
