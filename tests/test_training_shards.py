"""train-mtp past one sitting: the self-generated data lives in shards with their provenance and a stopped run
resumes them bitwise; training resumes bitwise; the GPU script's CPU path writes weights in files under a limit
that the engine loads back."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from compiled_spec import LLM, SamplingParams
from compiled_spec.loading.tokenizer import load_tokenizer
from compiled_spec.training import self_generated, train_mtp as train_mtp_module
from compiled_spec.training.self_generated import records_digest, self_generated_windows
from compiled_spec.training.train_mtp import load_base, load_config, save_weights, train_mtp
from serving import write_chat_model

GENERATION = {"base_model_sha256": "digest of the base", "seed": 0, "dtype": "float32"}
TEXTS = ["def fib(n):", "ROMEO: But soft, what light", "import os", "class Stack:\n    def push(self, item):",
         "x = 1", "for i in range(10):", "JULIET: O Romeo"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base_dir = write_chat_model(tmp_path_factory.mktemp("base") / "base")
    tokenizer = load_tokenizer(base_dir)
    return base_dir, load_base(base_dir)[0], [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def generate(base, prompts, shards, generation=GENERATION, length=48):
    # 7 prompts in shards of 2 windows, 2 shards a batch: shards 0-1 and 2-3 (the last holds one window).
    return self_generated_windows(base, prompts, length, 4, shards, "test", generation, 2)


def counting_prefills(base):
    counted = []
    handle = base.model.embed_tokens.register_forward_hook(
        lambda module, args, out: counted.append(args[0].shape[0]) if args[0].shape[1] > 1 else None)
    return counted, handle


def test_a_stopped_generation_resumes_from_its_shards_to_the_same_bytes(tiny, tmp_path, monkeypatch):
    """A run stopped after its first batch, with a half-written shard left behind, then run again, generates only
    the batch it lacks, and every shard file is byte for byte the one an uninterrupted run writes. Each shard is
    under 16 MiB and records its provenance."""
    _, base, prompts = tiny
    whole, whole_records = generate(base, prompts, tmp_path / "whole")

    real = self_generated.continue_batch
    calls = []

    def stopped_after_one_batch(*args):
        calls.append(1)
        if len(calls) == 2:
            (tmp_path / "stopped" / "00002.tmp").write_bytes(b"half a shard")  # killed while writing
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(self_generated, "continue_batch", stopped_after_one_batch)
    with pytest.raises(KeyboardInterrupt):
        generate(base, prompts, tmp_path / "stopped")
    monkeypatch.setattr(self_generated, "continue_batch", real)
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir()) == ["00000.safetensors", "00001.safetensors",
                                                                         "00002.tmp"]
    counted, handle = counting_prefills(base)
    resumed, resumed_records = generate(base, prompts, tmp_path / "stopped")
    handle.remove()
    assert counted == [3]  # prompts 4 to 6 only
    for key in whole:
        assert torch.equal(resumed[key], whole[key]), key
    assert resumed_records == whole_records
    for index in range(4):
        name = f"{index:05d}.safetensors"
        assert (tmp_path / "stopped" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
        assert (tmp_path / "whole" / name).stat().st_size <= 16 << 20
    with safe_open(str(tmp_path / "whole" / "00003.safetensors"), framework="pt") as handle:
        record = json.loads(handle.metadata()["provenance"])
    assert record == {**GENERATION, "generate_batch_size": 4, "shard": 3, "windows": 1, "length": 48,
                      "prompts_sha256": self_generated.prompts_digest(prompts[6:])}


def test_a_shard_made_for_other_data_is_regenerated_and_says_why(tiny, tmp_path, capsys):
    """Shards whose base model, prompts or dtype differ from this run's are not reused: the run names the shard
    and the difference, and generates it again; an unreadable shard too. The others are kept. Windows too long
    to fit one shard are refused."""
    _, base, prompts = tiny
    shards = tmp_path / "shards"
    generate(base, prompts, shards)
    capsys.readouterr()

    counted, handle = counting_prefills(base)
    changed = [*prompts[:2], prompts[3], prompts[2], *prompts[4:]]  # shard 1's prompts swap places
    generate(base, changed, shards)
    assert counted == [4]  # the batch of shards 0 and 1
    printed = capsys.readouterr().out
    assert "00001.safetensors: made for other data (prompts_sha256 is" in printed
    assert "00000.safetensors" not in printed

    generate(base, changed, shards, {**GENERATION, "base_model_sha256": "another base"})
    assert counted == [4, 4, 3]
    assert "base_model_sha256 is 'digest of the base', this run's is 'another base'" in capsys.readouterr().out

    (shards / "00003.safetensors").write_bytes(b"truncated")
    generate(base, changed, shards, {**GENERATION, "base_model_sha256": "another base"})
    assert counted == [4, 4, 3, 3]
    assert "00003.safetensors: unreadable" in capsys.readouterr().out

    with pytest.raises(ValueError, match="corpus.shard_windows=2000 windows of 48 tokens are .* over 16 MiB"):
        self_generated_windows(base, prompts, 48, 4, shards, "test", GENERATION, 2000)


MEMORY_PROBE = """
import json, resource, sys, types
from pathlib import Path
import torch
from safetensors.torch import save_file
from compiled_spec.training.self_generated import prompts_digest, self_generated_windows

shards, windows, length, hidden = Path(sys.argv[1]), 32, 128, 576
prompts = [[1 + i, 2, 3] for i in range(40 * windows)]
generation = {"base_model_sha256": "b", "seed": 0, "dtype": "float32"}
shards.mkdir()
for index in range(40):
    record = {**generation, "generate_batch_size": 256, "shard": index, "windows": windows, "length": length,
              "prompts_sha256": prompts_digest(prompts[index * windows: (index + 1) * windows])}
    ids = torch.zeros(windows, length, dtype=torch.long)
    part = {"ids": ids, "greedy": ids.clone(), "hidden": torch.full((windows, length, hidden), float(index))}
    save_file(part, str(shards / f"{index:05d}.safetensors"), metadata={"provenance": json.dumps(record)})
del ids, part
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
base = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden))
data, records = self_generated_windows(base, prompts, length, 256, shards, "probe", generation, windows)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert data["hidden"][::windows, 0, 0].tolist() == [float(i) for i in range(40)]
data_kib = sum(value.numel() * value.element_size() for value in data.values()) // 1024
print(json.dumps({"grew_kib": after - before, "data_kib": data_kib}))
"""


def test_windows_read_from_shards_are_held_in_memory_once(tmp_path):
    """Reading a corpus from its shards (370 MiB here) grows peak memory by little more than the windows' bytes: a
    corpus held twice (every shard, then their concatenation) ran a 24 GiB machine out of memory at 1.5x the
    shipped modules' text."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "shards")], capture_output=True,
                         text=True, check=True).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    assert measured["data_kib"] > 350 * 1024, measured
    assert measured["grew_kib"] < 1.1 * measured["data_kib"], measured


def test_weights_split_under_a_file_limit_load_back_whole(tmp_path):
    state = {f"model.layers.{i}.mlp.weight": torch.randn(64, 64) for i in range(5)} | {"d2t": torch.arange(7)}
    files = save_weights(state, tmp_path, {"format": "pt"}, 40_000)
    assert len(files) == 3 and all(path.stat().st_size <= 40_000 for path in files)
    loaded = {}
    for path in files:
        loaded.update(load_file(str(path)))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def tiny_config(tmp_path, base_dir, name) -> dict:
    config = load_config(None, {"model": str(base_dir), "work_dir": str(tmp_path / f"{name}_work"),
                                "output_dir": str(tmp_path / name), "draft_vocab_size": 96})
    config["corpus"].update(domains=["code", "chat"], code_chars=24000, prompts={"code": 12, "chat": 6},
                            function_prompts=4, later_code_chars=0, fresh_code_prompts=0, fresh_function_prompts=0,
                            prompt_tokens=24, held_out_prompts=2, generate_batch_size=8, shard_windows=4)
    config["training"].update(num_threads=1, sequence_length=96, batch_size=4, max_steps=12, warmup_steps=2,
                              learning_rate=3e-3, log_every=1, eval_every=6, eval_windows=2, checkpoint_every=4)
    return config


def test_training_stopped_and_resumed_ends_with_the_same_bytes(tiny, tmp_path, monkeypatch):
    """A run stopped at step 7 (its last checkpoint at step 4) and resumed writes weights byte for byte those of
    an uninterrupted run, reusing the shards the first run made; training_log.json records the shards'
    provenance: the base model's sha256 and a digest of each set's shard records."""
    import shutil

    base_dir = tiny[0]
    config = tiny_config(tmp_path, base_dir, "whole")
    train_mtp(config)
    stopped = tiny_config(tmp_path, base_dir, "stopped")
    shutil.copytree(tmp_path / "whole_work" / "shards", tmp_path / "stopped_work" / "shards")

    real, steps = train_mtp_module.MtpTraining.batch_losses, []

    def stopped_at_step_7(self, generator):
        steps.append(1)
        if len(steps) == 8:
            raise KeyboardInterrupt
        return real(self, generator)

    monkeypatch.setattr(train_mtp_module.MtpTraining, "batch_losses", stopped_at_step_7)
    monkeypatch.setattr(self_generated, "continue_batch", None)  # the copied shards are all it needs
    with pytest.raises(KeyboardInterrupt):
        train_mtp(stopped)
    monkeypatch.setattr(train_mtp_module.MtpTraining, "batch_losses", real)
    assert torch.load(tmp_path / "stopped_work" / "checkpoint.pt", weights_only=True)["step"] == 4
    log = train_mtp(stopped, resume=True)
    assert [row["step"] for row in log["history"]["train"]] == list(range(1, 13))
    # Tensor by tensor: safetensors writes the metadata's keys in no fixed order.
    whole, resumed = (load_file(str(tmp_path / name / "mtp.safetensors")) for name in ("whole", "stopped"))
    assert whole.keys() == resumed.keys()
    assert all(whole[key].numpy().tobytes() == resumed[key].numpy().tobytes() for key in whole)

    provenance = json.loads((tmp_path / "whole" / "training_log.json").read_text())["data_provenance"]
    assert provenance["base_model"]["sha256"] == self_generated.checkpoint_digest(base_dir)
    assert set(provenance["sets"]) == {"code_train", "code_held_out", "chat_train", "chat_held_out"}
    code = provenance["sets"]["code_train"]
    assert (code["shards"], code["windows"], code["seeds"]) == (4, 16, [0])
    records = []
    for index in range(4):
        with safe_open(str(tmp_path / "whole_work" / "shards" / "code_train" / f"{index:05d}.safetensors"),
                       framework="pt") as handle:
            records.append(json.loads(handle.metadata()["provenance"]))
    assert code["records_sha256"] == records_digest(records)
    assert json.loads((tmp_path / "stopped" / "training_log.json").read_text())["data_provenance"] == provenance


def test_gpu_script_runs_on_the_cpu_and_its_split_weights_attach(tiny, tmp_path):
    """The prepared GPU command, on the CPU with the tiny model: every output file under the limit, the weights
    in several files, and the engine attaches them with output equal to k=0."""
    from compiled_spec.training import gpu_run

    base_dir = tiny[0]
    config_file = tmp_path / "config.json"
    config = tiny_config(tmp_path, base_dir, "unused")
    config["corpus"].update(fresh_code_prompts=2, fresh_code_rounds=3)
    config_file.write_text(json.dumps(config))
    out = tmp_path / "gpu_out"
    log = gpu_run.main(["--out", str(out), "--config", str(config_file), "--device", "cpu", "--text-scale", "2",
                        "--generate-batch-size", "8", "--max-steps", "4", "--max-file-mib", "0.1"])
    assert log["train_tokens"] == {"code": (12 + 4 + 3 * 2 * 2) * 96, "chat": 6 * 96}  # 3 rounds of 2 * 2
    weights = sorted(out.glob("*.safetensors"))
    assert len(weights) > 1 and all(path.stat().st_size <= 0.1 * 2**20 for path in out.iterdir())
    engine = dict(graph_mode="eager", max_seq_len=96, max_batch_size=2, show_progress=False)
    plain = LLM(base_dir, num_speculative_tokens=0, **engine)
    drafting = LLM(base_dir, mtp=out, num_speculative_tokens=2, **engine)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = ["def fib(n):", "ROMEO: But soft"]
    assert [o.token_ids for o in drafting.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
