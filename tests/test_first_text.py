"""The README's first command, as written, on a fresh machine with the network blocked: no compiled packages, no built
CPU kernels, no proxy, and the package index and model hub at an unroutable address. Text starts in eager without
waiting for the kernels (the background compile builds them), the background compile's progress never lands inside
the streamed text, even where stdout and stderr are one file (a terminal, `2>&1`), and a later run loads the
packages that compile made and decodes in full."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from compiled_spec.config import GRAPH_MODE_VARIABLE


UNROUTABLE = "http://192.0.2.1"  # TEST-NET-1: no host answers there
PROXIES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def fresh_machine(tmp_path) -> dict:
    environment = {key: value for key, value in os.environ.items()
                   if key != GRAPH_MODE_VARIABLE and key.lower() not in PROXIES}  # the real default mode, no proxy
    return {**environment, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
            "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "COMPILED_SPEC_COMPILE_WORKERS": "1",
            "PIP_INDEX_URL": f"{UNROUTABLE}/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
            "HF_ENDPOINT": UNROUTABLE}


def background_compile_pid(output: str) -> int:
    """The pid of the compile the run left running, as its last message names it (with where its log is)."""
    found = re.search(r"still compiling in the background \(pid (\d+), log (\S+)\.log\)", output)
    assert found, output
    return int(found.group(1))


def wait_for_exit(pid: int, timeout_s: float = 1200) -> None:
    """The compile is not this process's child (it outlives the run that started it): /proc says when it ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)  # the compile leads its own session: its workers go with it
            raise AssertionError(f"the background compile (pid {pid}) did not end within {timeout_s} s")
        time.sleep(0.5)


@pytest.mark.slow
def test_the_readme_command_offline_answers_before_the_kernels_are_built_and_a_later_run_loads_the_packages(tmp_path):
    environment = fresh_machine(tmp_path)
    command = [shutil.which("compiled-spec"), "generate", "ROMEO:", "--max-tokens", "24"]  # the README's command
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, env=environment, timeout=600)
    assert as_json.returncode == 0, as_json.stderr
    aggregate = json.loads(as_json.stdout.splitlines()[-1])["aggregate"]
    assert aggregate["graph_mode"] == "eager (full compiling in the background)", aggregate  # the default, tiered
    assert aggregate["cpu_kernels"] == "not needed", aggregate  # eager did not wait for a build
    pid = background_compile_pid(as_json.stderr)

    streamed = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                              timeout=600)  # one file for both, as on a terminal
    assert streamed.returncode == 0, streamed.stdout
    lines = streamed.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("ROMEO:")]
    assert starts, f"the text does not start a line of its own: {streamed.stdout!r}"
    text_start, stats = starts[0], next(i for i, line in enumerate(lines) if line.startswith("stats:"))
    assert any("compiling full graphs in the background" in line for line in lines[:text_start]), lines
    text = "\n".join(lines[text_start:stats])
    assert text.removeprefix("ROMEO:") == aggregate_text(as_json.stdout), text  # the same text, nothing inside it
    assert "compiling" not in text and "graph/s" not in text and "\r" not in streamed.stdout
    assert background_compile_pid(streamed.stdout) == pid  # the second run followed the first one's compile

    wait_for_exit(pid)
    later = subprocess.run([*command, "--json"], capture_output=True, text=True, env=environment, timeout=600)
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout.splitlines()[-1])["aggregate"]["graph_mode"] == "full", later.stderr
    assert "loading buckets" in later.stderr and "compiling" not in later.stderr, later.stderr  # loaded, not compiled
    assert aggregate_text(later.stdout) == aggregate_text(as_json.stdout)


def aggregate_text(json_lines: str) -> str:
    return json.loads(json_lines.splitlines()[0])["text"].rstrip("\n")
