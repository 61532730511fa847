"""benchmarks/cuda_check.py where no GPU is: its arguments, its table and JSON, and a clean exit without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from compiled_spec.benchmarks import cuda_check
from compiled_spec.benchmarks.cuda_check import ParityRow, Results, compare, format_table, parse_args, write_results


def test_arguments():
    args = parse_args([])
    assert args.modes == ("compile", "piecewise", "full") and args.batch_sizes == (1, 8) and args.anchor
    args = parse_args(["--modes", "full", "--batch-sizes", "1,4", "--max-autotune", "--no-anchor", "--out", "x"])
    assert args.modes == ("full",) and args.batch_sizes == (1, 4) and args.max_autotune and not args.anchor
    for bad in (["--modes", "fast"], ["--batch-sizes", "0"], ["--batch-sizes", "a"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_check.main(["--out", "unused"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_compare_splits_requests():
    eager = ([[1, 2], [3, 4]], [[(0, 1), (1, 2)], [(1, 0)]])
    same_greedy = ([[1, 2], [3, 5]], [[(0, 1), (1, 1)], [(1, 0)]])
    assert compare(eager, same_greedy, {0}) == (True, True)
    assert compare(eager, same_greedy, {1}) == (False, False)


def test_table_and_json(tmp_path):
    results = Results(device="NVIDIA H200", torch="2.11")
    results.parity = [ParityRow("full", "greedy", "off", True, True, 40, 0, 0),
                      ParityRow("piecewise", "seeded", "saturated", False, True, 40, 0, 9),
                      ParityRow("compile", "greedy", "off", error="RuntimeError: boom")]
    results.tokens_per_s = {"eager": {"1": 10.0, "8": 50.5}, "hf-static": {"1": 30.0}}
    results.skipped = ["full+max-autotune: 20 s left"]
    table = format_table(results).splitlines()
    assert table[0].split() == ["mode", "sampling", "hisparse", "tokens=eager", "accepted=eager", "replays",
                                "skips", "partitions"]
    assert table[1].split()[-1] == "ok" and table[2].endswith("tokens differ") and "RuntimeError: boom" in table[3]
    assert "tokens/s" in table[5] and table[6].split() == ["eager", "10.0", "50.5"]
    assert table[7].split() == ["hf-static", "30.0", "-"] and table[-1] == "skipped: full+max-autotune: 20 s left"
    written = json.loads(write_results(results, tmp_path / "out").read_text())
    assert [row["ok"] for row in written["parity"]] == [True, False, False]
    assert written["tokens_per_s"]["eager"]["8"] == 50.5 and written["device"] == "NVIDIA H200"
