"""`compiled-spec bench` end to end on a tiny checkpoint: two eager cells and one anchor, each in its own process."""

import importlib.util
import json

import pytest
from click.testing import CliRunner

from compiled_spec import cli
from compiled_spec.benchmarks.anchors import ANCHORS, DEFAULT_ANCHORS


@pytest.fixture(scope="module")
def sweep(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["bench", "--model", str(tiny_checkpoint("predictive").path), "--graph-modes", "eager", "-k", "2",
            "--batch-sizes", "1,2", "--anchors", "hf-mtp", "--max-tokens", "12", "--threads", "1", "--buckets", "workload",
            "--out", str(out)]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    return result, out


def records(out, **match):
    found = json.loads((out / "results.json").read_text())["records"]
    return [r for r in found if all(r.get(key) == value for key, value in match.items())]


def test_bench_writes_json_markdown_and_plots(sweep):
    result, out = sweep
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("compiled-spec bench --model ")
    assert "--hisparse" not in results["command"]  # a flag that is off is left out, so the command reruns as is
    assert {"cpu", "torch", "transformers", "python", "load_average_at_start"} <= set(results["environment"])
    assert [r["name"] for r in results["records"]] == ["hf-mtp b=1", "hf-mtp b=2", "eager k=2 b=1", "eager k=2 b=2"]
    for record in records(out, kind="engine"):
        assert record["status"] == "ok", record
        assert record["tokens_per_s"] > 0 and record["generated_tokens"] == 8 * 12
        assert record["step_latency_ms"]["p50"] <= record["step_latency_ms"]["p90"]
        assert len(record["acceptance_rate_per_position"]) == 2
        assert 1 <= record["mean_accepted_length"] <= 3
        assert record["warmup_s"] == 0 and record["peak_rss_mib"] > 0
        assert record["weight_format"] == "float32" and record["weight_bytes"] >= record["main_weight_bytes"]
        assert set(record["speedup_vs"]) == set(ANCHORS) | {"plain-limit"}
        limit = record["batch_size"] * results["environment"]["read_bandwidth_gb_s"] * 1e9 / record["main_weight_bytes"]
        assert record["plain_decoding_limit_tokens_per_s"] == pytest.approx(limit)
        assert record["speedup_vs"]["plain-limit"] == pytest.approx(record["tokens_per_s"] / limit)
    (anchor,) = records(out, name="hf-mtp b=1")
    assert anchor["status"] == "ok" and anchor["tokens_per_s"] > 0 and anchor["num_speculative_tokens"] == 2
    (skipped,) = records(out, name="hf-mtp b=2")
    assert skipped["status"] == "unavailable" and "batch size 1" in skipped["reason"]
    readings = results["environment"]["read_bandwidth_readings_gb_s"]
    assert set(readings) == {"start", "end"} and all(value > 0 for value in readings.values())
    assert results["environment"]["read_bandwidth_gb_s"] == max(readings.values())
    assert results["environment"]["plain_cells_over_limit"] == []  # no cell here decodes plainly
    table = (out / "results.md").read_text()
    assert "× plain limit" in table and "GB/s at start" in table and "The probe read low" not in table
    assert "| peak RSS MiB | weights MiB | weights |" in table
    assert "| eager | 2 | 1 |" in table and "| eager | 2 | 2 |" in table and "| hf-mtp | 1 |" in table
    assert table in result.output
    for name in ("tokens_per_s.png", "acceptance.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")


def test_workload_buckets_pad_each_prompt_as_the_default_engine_does(sweep):
    from compiled_spec.engine.buckets import default_prefill_buckets

    from compiled_spec.benchmarks.engine_cell import cell_buckets

    prompts = [[1] * 5, [1] * 20, [1] * 17, [1] * 40, [1] * 90]
    # eager compiles nothing, and its default buckets reach max_seq_len; on CPU full's stop at 256 and the other
    # compiled modes' at 64, and longer prompts prefill in eager.
    assert cell_buckets("workload", "eager", 2, prompts, 100) == ((2,), (16, 32, 64, 100))
    assert cell_buckets("workload", "full", 2, prompts, 100) == ((2,), (16, 32, 64, 100))
    assert cell_buckets("workload", "compile", 2, prompts, 100) == ((2,), (16, 32, 64))
    assert cell_buckets("workload", "full", 1, [[1] * 90, [1] * 300], 400) == ((1,), (128,))
    assert cell_buckets("workload", "piecewise", 1, [[1] * 90], 100) == ((1,), (16,))
    assert cell_buckets("minimal", "full", 4, prompts, 100) == ((4,), (100,))
    assert cell_buckets("default", "full", 4, prompts, 100) == (None, None)
    _, out = sweep
    for record in records(out, kind="engine"):
        assert record["batch_buckets"] == [record["batch_size"]]
        assert set(record["prefill_buckets"]) <= set(default_prefill_buckets(record["prefill_buckets"][-1]))


def test_eager_cells_with_the_same_k_accept_the_same(sweep):
    """Every cell decodes the same prompts; greedy acceptance cannot depend on how many share a batch."""
    _, out = sweep
    one, two = records(out, kind="engine")
    assert one["accepted_per_position"] == two["accepted_per_position"]
    assert one["output_digests"] == two["output_digests"]
    assert sum(one["accepted_per_position"]) > 0


@pytest.mark.slow
def test_bench_compares_auto_with_the_best_fixed_k(tiny_checkpoint, tmp_path):
    args = ["bench", "--model", str(tiny_checkpoint("predictive").path), "--graph-modes", "eager", "-k", "0,2,auto",
            "--anchors", "none", "--max-tokens", "12", "--threads", "1", "--rounds", "2", "--out", str(tmp_path)]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    assert result.exit_code == 0, result.output
    plain, fixed, auto = records(tmp_path, kind="engine")
    for record in (plain, fixed, auto):  # each cell ran in a fresh process per round and kept its fastest
        assert len(record["rounds_tokens_per_s"]) == 2 and record["tokens_per_s"] == max(record["rounds_tokens_per_s"])
    assert len(list((tmp_path / "logs").glob("*_round2.log"))) == 3
    assert auto["num_speculative_tokens"] == "auto" and auto["status"] == "ok"
    assert auto["output_digests"] == plain["output_digests"] == fixed["output_digests"]
    assert sum(auto["steps_per_num_drafts"].values()) == auto["steps"]
    assert set(auto["steps_per_num_drafts"]) <= {"0", "1", "2", "3"}
    assert set(auto["auto_step_seconds"]) == {"0", "1", "2", "3"}
    best = max((plain, fixed), key=lambda r: r["tokens_per_s"])
    assert auto["best_fixed_k"] == best["num_speculative_tokens"]
    assert auto["auto_over_best_fixed_k"] == pytest.approx(auto["tokens_per_s"] / best["tokens_per_s"])
    forced = auto["same_process_tokens_per_s"]
    assert set(forced) == {"0", "1", "2", "3", "auto"} and min(forced.values()) > 0
    fixed = {k: rate for k, rate in forced.items() if k != "auto"}
    assert auto["same_process_best_fixed_k"] == max(fixed, key=fixed.get)
    assert auto["same_process_auto_over_best_fixed_k"] == pytest.approx(forced["auto"] / max(fixed.values()))
    table = (tmp_path / "results.md").read_text()
    assert "| eager | auto | 1 |" in table and "k = auto chooses k before each step" in table
    assert "in each of 2 rounds" in table
    assert (tmp_path / "tokens_per_s.png").read_bytes().startswith(b"\x89PNG")


def test_bench_compares_auto_with_a_tree_against_each_chain_and_the_tree(tiny_checkpoint, tmp_path):
    args = ["bench", "--model", str(tiny_checkpoint("predictive").path), "--graph-modes", "eager", "-k", "auto",
            "--draft-tree", "2,1", "--anchors", "none", "--max-tokens", "12", "--threads", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    assert result.exit_code == 0, result.output
    cells = {(r["num_speculative_tokens"], bool(r["draft_tree"])): r for r in records(tmp_path, kind="engine")}
    auto = cells[("auto", True)]
    assert auto["status"] == "ok" and auto["output_digests"] == cells[(2, True)]["output_digests"]
    assert set(auto["same_process_tokens_per_s"]) == {"0", "1", "2", "3", "tree", "auto"}
    assert set(auto["auto_step_seconds"]) == {"0", "1", "2", "3", "tree"}
    assert 0 <= auto["tree_steps"] <= auto["steps"]
    assert auto["same_process_best_fixed_k"] in {"0", "1", "2", "3", "tree"}


def test_bench_hisparse_reaches_every_engine_cell(tiny_checkpoint, tmp_path):
    args = ["bench", "--model", str(tiny_checkpoint("predictive").path), "--graph-modes", "eager", "-k", "1",
            "--anchors", "none", "--max-tokens", "6", "--threads", "1", "--out", str(tmp_path),
            "--hisparse", "--top-k-tokens", "4", "--hot-rows", "8"]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    assert result.exit_code == 0, result.output
    (record,) = records(tmp_path, kind="engine")
    assert record["status"] == "ok" and record["generated_tokens"] == 8 * 6
    assert (record["hisparse_top_k_tokens"], record["hot_buffer_rows"], record["hisparse_scorer"]) == (4, 8, "keys")
    assert "Every engine cell decodes with HiSparse: top 4 tokens per query through 8 hot rows" in result.output
    command = json.loads((tmp_path / "results.json").read_text())["command"]
    assert " --hisparse --top-k-tokens 4 --hot-rows 8" in command


def test_bench_records_packed_weights_at_their_packed_size(tiny_checkpoint, tmp_path):
    """--quantize reaches every engine cell; weight_bytes counts each tensor the model holds once (the packed parts
    of a matrix, not a float copy), and the table shows the MiB and the format."""
    from compiled_spec import LLM
    from compiled_spec.model.packed_linear import PackedLinear

    path = tiny_checkpoint("llama_tied").path
    args = ["bench", "--model", str(path), "--graph-modes", "eager", "-k", "0", "--anchors", "none",
            "--max-tokens", "4", "--threads", "1", "--out", str(tmp_path), "--quantize", "q8_0"]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    assert result.exit_code == 0, result.output
    (record,) = records(tmp_path, kind="engine")
    assert record["status"] == "ok" and record["weight_format"] == "Q8_0 packed"
    settings = dict(graph_mode="eager", num_speculative_tokens=0, max_seq_len=64, show_progress=False)
    packed, plain = LLM(path, quantize="q8_0", **settings).model, LLM(path, **settings).model
    quantized = sum(m.out_features * m.in_features for m in packed.modules() if isinstance(m, PackedLinear))
    plain_bytes = sum(t.nbytes for t in [*plain.parameters(), *plain.buffers()])  # the tied head is one parameter
    # Each packed weight: one int8 and a float16 scale per 32 values (Q8_0's scales are float16 in the file, so
    # exact), in place of a float32.
    assert record["weight_bytes"] == plain_bytes - 4 * quantized + quantized + quantized // 32 * 2
    assert f"| {record['weight_bytes'] / 2**20:.1f} | Q8_0 packed |" in result.output
    assert " --quantize q8_0" in json.loads((tmp_path / "results.json").read_text())["command"]


def test_bench_drafts_with_the_mtp_modules_and_dtype_it_is_given(tiny_checkpoint, tmp_path):
    """--mtp and --draft-dtype reach every engine cell (as a requantized copy of a named model needs its modules)."""
    from test_draft_vocab import mtp_directory

    checkpoint = tiny_checkpoint("predictive")
    modules = mtp_directory(checkpoint.path, tmp_path / "modules", None)
    args = ["bench", "--model", str(checkpoint.path), "--graph-modes", "eager", "-k", "1", "--anchors", "none",
            "--max-tokens", "6", "--threads", "1", "--out", str(tmp_path / "out"), "--mtp", str(modules),
            "--draft-dtype", "float16"]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    assert result.exit_code == 0, result.output
    (record,) = records(tmp_path / "out", kind="engine")
    assert record["status"] == "ok" and record["draft_weight_dtype"] == "float16"
    assert f" --mtp {modules} --draft-dtype float16" in json.loads((tmp_path / "out" / "results.json").read_text())["command"]


def test_bench_rejects_a_hot_buffer_smaller_than_top_k(tmp_path):
    args = ["bench", "--hisparse", "--top-k-tokens", "16", "--hot-rows", "8", "--out", str(tmp_path)]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    assert result.exit_code == 2
    assert "hot_rows=8 is smaller than top_k_tokens=16" in result.stderr
    assert not (tmp_path / "results.json").exists()


def test_bench_rejects_a_hot_buffer_too_small_for_a_trees_leaves(tmp_path):
    args = ["bench", "--hisparse", "--top-k-tokens", "4", "--hot-rows", "8", "-k", "2", "--draft-tree", "2,2",
            "--out", str(tmp_path)]
    result = CliRunner().invoke(cli.main, args, prog_name="compiled-spec")
    assert result.exit_code == 2
    assert "writes up to 5 new rows per layer (num_speculative_tokens=2 and a token tree's 2 leaves)" in result.stderr
    assert not (tmp_path / "results.json").exists()


def test_bench_rejects_an_unknown_graph_mode():
    result = CliRunner().invoke(cli.main, ["bench", "--graph-modes", "eager,fast"], prog_name="compiled-spec")
    assert result.exit_code == 2
    assert "'eager,fast': choose a comma-separated list of eager, compile, piecewise, full" in result.stderr


def test_cli_anchor_names_mirror_the_benchmarks():
    assert cli.ANCHORS == ANCHORS and cli.DEFAULT_ANCHORS == DEFAULT_ANCHORS


@pytest.mark.slow
def test_bench_on_a_gguf_file_runs_transformers_and_llama_cpp_anchors(tmp_path):
    from tiny_gguf import write_gguf

    path, _ = write_gguf(tmp_path, "llama", "Q8_0")
    out = tmp_path / "bench"
    result = CliRunner().invoke(cli.main, [
        "bench", "--model", str(path), "--graph-modes", "eager", "-k", "0", "--batch-sizes", "1,2",
        "--anchors", "hf-eager,llama-cpp,llama-cpp-f32", "--max-tokens", "8", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for record in records(out, kind="engine"):
        assert record["status"] == "ok" and record["outputs_equal_to_hf_eager"] == record["requests"] == 8
    (hf,) = records(out, name="hf-eager b=1")
    for name in ("llama-cpp b=1", "llama-cpp-f32 b=1"):
        (anchor,) = records(out, name=name)
        if importlib.util.find_spec("llama_cpp") is None:
            assert anchor["status"] == "unavailable" and "llama-cpp-python is not installed" in anchor["reason"]
        else:
            assert anchor["status"] == "ok" and anchor["generated_tokens"] == 8 * 8
            if name == "llama-cpp-f32 b=1":  # the same F32 weights: the same greedy tokens as transformers
                assert anchor["output_digests"] == hf["output_digests"]
                assert (tmp_path / "model.F32.gguf").stat().st_size > path.stat().st_size
    (batched,) = records(out, name="llama-cpp b=2")
    assert batched["status"] == "unavailable"


def test_a_plain_cell_faster_than_the_plain_limit_says_the_probe_read_low(sweep):
    from compiled_spec.benchmarks.bandwidth import limit_bandwidth, plain_cells_over_limit
    from compiled_spec.benchmarks.report import bandwidth_text

    _, out = sweep
    environment = json.loads((out / "results.json").read_text())["environment"]
    (speculative,) = records(out, name="eager k=2 b=1")
    speculative = {**speculative, "speedup_vs": {**speculative["speedup_vs"], "plain-limit": 2.4}}
    plain = {**speculative, "name": "eager k=0 b=1", "num_speculative_tokens": 0}
    plain["speedup_vs"] = {**speculative["speedup_vs"], "plain-limit": 1.52}
    slower = {**plain, "name": "eager k=0 b=2", "speedup_vs": {**plain["speedup_vs"], "plain-limit": 0.9}}
    # Speculation may beat the limit; plain decoding beating it means the probe read low.
    assert plain_cells_over_limit([speculative, plain, slower]) == ["eager k=0 b=1"]
    assert limit_bandwidth({"start": 16.8, "end": 32.0}) == 32.0
    assert limit_bandwidth({"start": None, "end": 31.5}) == 31.5 and limit_bandwidth({"start": None}) is None
    text = bandwidth_text({**environment, "plain_cells_over_limit": ["eager k=0 b=1"]})
    start = environment["read_bandwidth_readings_gb_s"]["start"]
    assert f"{start:.1f} GB/s at start" in text and "The probe read low:** eager k=0 b=1" in text
