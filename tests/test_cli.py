"""The `compiled-spec` command on tiny random checkpoints: output, JSON, exit codes, error lines."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiled_spec import cli
from compiled_spec import GraphMode
from compiled_spec.cli_format import Streamer
from compiled_spec.loading.checkpoint import QUANTIZE_TYPES
from compiled_spec.config import DEFAULT_MAX_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS
from compiled_spec.training.mtp_corpus import DOMAINS
from compiled_spec.training.train_tokenizer import train_byte_level_bpe
from tiny_checkpoints import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
# The install line of the README and of .ci/run: the torch the suite is run on.
INSTALL = "pip install torch==2.14.1 -e '.[test]'"
SMALL = ["--max-tokens", "6", "--max-seq-len", "64", "--max-batch-size", "2"]


@pytest.fixture(scope="session")
def ids_model(tmp_path_factory) -> str:
    """A tiny Llama with 2 MTP modules and no tokenizer: prompts are token ids (vocab 96)."""
    path = tmp_path_factory.mktemp("cli_ids_model")
    write_checkpoint(path, architecture="llama", num_mtp_modules=2)
    return str(path)


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> str:
    """A tiny Llama with 2 MTP modules and a byte-level BPE tokenizer."""
    path = tmp_path_factory.mktemp("cli_text_model")
    tokenizer = train_byte_level_bpe(["ROMEO: But soft, what light through yonder window breaks?\n" * 10], 300)
    write_checkpoint(path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(str(path))
    return str(path)


def invoke(*args):
    return CliRunner().invoke(cli.main, ["generate", *args], prog_name="compiled-spec")


def test_generate_prints_the_text_then_one_stats_line(text_model):
    result = invoke("ROMEO:", "--model", text_model, *SMALL)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ROMEO:")
    assert re.fullmatch(
        r"stats: \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\) \| k=3, acceptance by draft position: "
        r"\d+% \d+% \d+% \| mean accepted length [\d.]+ tokens/step over \d+ steps \| weights: float32", lines[-1]
    ), lines[-1]


def test_streamed_text_is_the_final_text(text_model):
    streamed = invoke("ROMEO:", "--model", text_model, "--ignore-eos", *SMALL)
    as_json = invoke("ROMEO:", "--model", text_model, "--ignore-eos", "--json", *SMALL)
    record = json.loads(as_json.stdout.splitlines()[0])
    assert streamed.stdout.rsplit("\nstats: ", 1)[0] == "ROMEO:" + record["text"]


def test_json_has_one_record_per_prompt_and_the_aggregate(ids_model):
    result = invoke("--prompt-ids", "2,3,4", "--prompt-ids", "5, 6", "--model", ids_model, "--json", "-k", "2",
                    "--ignore-eos", *SMALL)
    assert result.exit_code == 0, result.output
    *records, aggregate = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == [[2, 3, 4], [5, 6]]
    for record in records:
        assert record["finish_reason"] == "length" and record["error"] is None
        assert len(record["token_ids"]) == 6 and record["text"] == ""
        assert record["stats"]["num_speculative_tokens"] == 2
        assert len(record["stats"]["acceptance_rate_per_position"]) == 2
        assert record["stats"]["mean_accepted_length"] >= 1.0
    total = aggregate["aggregate"]
    assert total["requests"] == 2 and total["errors"] == 0 and total["generated_tokens"] == 12
    assert total["stats"]["steps"] == sum(r["stats"]["steps"] for r in records)
    assert total["tokens_per_s"] > 0 and total["graph_mode"] == "eager" and total["weight_format"] == "float32"
    assert total["cpu_kernels"] in ("built", "not needed")  # eager needs none; "not built: <why>" would say why


def test_draft_tree_decodes_the_same_tokens_and_says_so(ids_model):
    def aggregate_and_tokens(*args):
        result = invoke("--prompt-ids", "2,3,4", "--model", ids_model, "--json", "--ignore-eos", *args, *SMALL)
        assert result.exit_code == 0, result.output
        record, aggregate = [json.loads(line) for line in result.stdout.splitlines()]
        return aggregate["aggregate"], record["token_ids"]

    tree, tree_tokens = aggregate_and_tokens("--draft-tree", "2,2")
    _, plain_tokens = aggregate_and_tokens("-k", "0")
    assert tree_tokens == plain_tokens
    assert tree["draft_tree"] == [2, 2] and tree["num_speculative_tokens"] == 2
    assert len(tree["stats"]["acceptance_rate_per_position"]) == 2
    stats = tree["stats"]
    assert stats["tree_steps"] == stats["steps"] > 0
    line = invoke("--prompt-ids", "2,3,4", "--model", ids_model, "--draft-tree", "2,2", *SMALL).stdout.splitlines()[-1]
    assert "| k=2 (tree 2,2), acceptance by draft position: " in line
    assert f"| {stats['steps']} steps verified the tree, {stats['leaf_steps']} ended on a leaf |" in line


def test_several_prompts_print_a_header_each(ids_model):
    result = invoke("--prompt-ids", "2,3", "--prompt-ids", "7", "--model", ids_model, "-k", "0", *SMALL)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("--- prompt 1 of 2: ") and lines[1].startswith("2 3 -> ")
    assert lines[2].startswith("--- prompt 2 of 2: ") and lines[3].startswith("7 -> ")
    assert lines[-1].startswith("stats: ") and "| k=0: no speculation |" in lines[-1] and lines[-1].endswith("| weights: float32")


def test_a_failed_prompt_exits_1_after_printing_the_others(ids_model):
    result = invoke("--prompt-ids", "2,3", "--prompt-ids", "2,999", "--model", ids_model, *SMALL)
    assert result.exit_code == 1
    assert "2 3 -> " in result.stdout and "1 of 2 prompts failed" in result.stdout
    assert result.stderr == "error: prompt 2: token ids must be integers in 0..95\n"


@pytest.mark.parametrize("args, named", [
    (["-k", str(MAX_SPECULATIVE_TOKENS + 1)], f"num_speculative_tokens={MAX_SPECULATIVE_TOKENS + 1}"),
    (["-k", "-1"], "num_speculative_tokens=-1"),
    (["--temperature", "-0.5"], "temperature=-0.5"),
    (["--top-p", "0"], "top_p=0.0"),
    (["--top-p", "1.5"], "top_p=1.5"),
    (["--graph-mode", "turbo"], "'turbo'"),
    (["--max-seq-len", "100000"], "max_seq_len=100000"),
    (["--prompt-ids", "1,x"], "'1,x'"),
    (["--prompt-ids", ""], "prompt 2 is empty"),
    (["--seed", "-3"], "-3"),
    (["--max-tokens", "many"], "'many'"),
    (["--draft-tree", "2,5"], "width 5 is out of range; allowed 1..4"),
    (["--draft-tree", "2,1", "-k", "3", "--max-seq-len", "64"], "draft_tree='2,1' is 2 deep but num_speculative_tokens=3"),
])
def test_bad_input_is_one_error_line_and_exit_2(ids_model, args, named):
    result = invoke("--prompt-ids", "2,3", "--model", ids_model, *args)
    assert_input_error(result, named)


def test_missing_config_json_is_an_input_error(tmp_path):
    assert_input_error(invoke("ROMEO:", "--model", str(tmp_path)), f"no config.json in {str(tmp_path)!r}")


def test_empty_prompt_is_an_input_error(text_model):
    assert_input_error(invoke("", "--model", text_model), "prompt 1 is empty ('')")


def test_text_prompt_without_a_tokenizer_points_to_prompt_ids(ids_model):
    assert_input_error(invoke("ROMEO:", "--model", ids_model, *SMALL), "has no tokenizer; pass prompts as --prompt-ids")


def test_no_prompt_is_an_input_error(ids_model):
    assert_input_error(invoke("--model", ids_model), "no prompt given")


def assert_input_error(result, named: str):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert named in result.stderr


def test_help_teaches_speculative_decoding():
    group = CliRunner().invoke(cli.main, ["--help"], prog_name="compiled-spec")
    command = CliRunner().invoke(cli.main, ["generate", "--help"], prog_name="compiled-spec")
    assert group.exit_code == command.exit_code == 0
    assert "draft k tokens" in group.stdout and "Examples:" in group.stdout and "generate" in group.stdout
    words = " ".join(command.stdout.split())
    for text in ["--num-speculative-tokens", "acceptance rate", "mean accepted length", "Examples:", "--prompt-ids"]:
        assert text in words


def test_cli_choices_mirror_the_engine():
    assert cli.GRAPH_MODES == tuple(mode.value for mode in GraphMode)
    assert cli.DOMAINS == DOMAINS
    assert cli.MAX_SPECULATIVE_TOKENS == MAX_SPECULATIVE_TOKENS
    assert cli.DEFAULT_MAX_SPECULATIVE_TOKENS == DEFAULT_MAX_SPECULATIVE_TOKENS
    assert cli.QUANTIZE_TYPES == QUANTIZE_TYPES


def test_weight_options_reach_the_engine_and_the_stats_name_the_format(ids_model, tmp_path):
    """--dequantize and --quantize (generate and serve share them with the engine options) load the weights as asked;
    the stats line and the JSON aggregate say how they are held."""
    from tiny_gguf import write_gguf

    gguf_path, _ = write_gguf(tmp_path, "llama", "Q4_1")
    ids = ["--prompt-ids", "2,3,4", "-k", "0", *SMALL]
    runs = {"packed": invoke("--model", str(gguf_path), *ids), "widened": invoke("--model", str(gguf_path),
                                                                                 "--dequantize", *ids),
            "quantized": invoke("--model", ids_model, "--quantize", "q8_0", "--json", *ids)}
    assert all(result.exit_code == 0 for result in runs.values()), {k: r.output for k, r in runs.items()}
    assert runs["packed"].stdout.splitlines()[-1].endswith(" | weights: Q4_1 packed")
    assert runs["widened"].stdout.splitlines()[-1].endswith(" | weights: float32")
    assert json.loads(runs["quantized"].stdout.splitlines()[-1])["aggregate"]["weight_format"] == "Q8_0 packed"
    for command in ("generate", "serve"):
        extra = ["--prompt-ids", "2"] if command == "generate" else []
        already = CliRunner().invoke(cli.main, [command, "--model", str(gguf_path), "--quantize", "q4_0", *extra])
        both = CliRunner().invoke(cli.main, [command, "--model", ids_model, "--quantize", "q4_0", "--dequantize",
                                             *extra])
        assert already.exit_code == both.exit_code == 2, (already.output, both.output)
        assert "error: model.gguf is already quantized (Q4_1)" in already.stderr
        assert "error: quantize='q4_0' with dequantize=True" in both.stderr


def test_stream_never_prints_a_stop_string():
    class Chars:  # a tokenizer whose token i is chr(i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    printed = []
    streamer = Streamer("P:", Chars(), ["\n\n"], lambda text, nl=True: printed.append(text + ("\n" if nl else "")))
    for piece, shown in [("a", "a"), ("\n", "a"), ("b", "a\nb"), ("\n", "a\nb"), ("\n", "a\nb"), ("c", "a\nb")]:
        streamer.on_tokens(0, [ord(piece)])
        assert "".join(printed) == "P:" + shown
    streamer.finish(type("Output", (), {"text": "a\nb", "finish_reason": "stop"})())
    assert "".join(printed) == "P:a\nb\n"


def test_console_script_is_installed():
    script = shutil.which("compiled-spec") or shutil.which("compiled-spec", path=str(Path(sys.executable).parent))
    assert script, f"the console script is missing; install with: {INSTALL}"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout


def ci_script_without_install(tmp_path: Path, readme: str) -> Path:
    """.ci/run in a folder of its own with this README, its pip install and its older-torch tier left out."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / ".ci").mkdir()
    script = (REPO / ".ci" / "run").read_text()
    for step in (INSTALL, "bash .ci/oldest-torch"):
        assert f"\n{step}\n" in script
        script = script.replace(f"\n{step}\n", "\ntrue\n")
    (tmp_path / ".ci" / "run").write_text(script)
    return tmp_path / ".ci" / "run"


def test_ci_runs_the_readme_commands(tmp_path):
    readme = (REPO / "README.md").read_text()
    install, test = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[0].splitlines()
    assert install.startswith(INSTALL)
    assert os.access(REPO / ".ci" / "run", os.X_OK)
    script = ci_script_without_install(tmp_path, readme.replace(test, "echo ran:$TORCHINDUCTOR_CACHE_DIR"))
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.splitlines()[-1].startswith("ran:/tmp/compiled-spec-inductor."), result  # a fresh cache
    assert f"+ {test}" in subprocess.run(  # the command CI runs is the README's, as written
        ["bash", str(ci_script_without_install(tmp_path / "real", readme))], capture_output=True, text=True,
        env={**os.environ, "PATH": f"{fake_python(tmp_path)}:{os.environ['PATH']}"}).stdout


def fake_python(tmp_path: Path) -> Path:
    """A folder whose `python` exits at once, so the README's test command runs without running the suite."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "python").write_text("#!/bin/sh\nexit 0\n")
    (folder / "python").chmod(0o755)
    return folder


def test_ci_fails_when_no_test_is_collected(tmp_path):
    """pytest exits 5 when a selection collects nothing: CI must fail then, not pass."""
    script = ci_script_without_install(tmp_path, f"```bash\n{INSTALL}\nexit 5\n```\n")
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 5 and "no tests collected" in result.stderr
