"""The README's first command on a fresh machine: no compiled packages and no built CPU kernels. Text starts in eager
without waiting for the kernels (the background compile builds them), and the background compile's progress never
lands inside the streamed text, even where stdout and stderr are one file (a terminal, `2>&1`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess

import pytest

from compiled_spec.config import GRAPH_MODE_VARIABLE


def fresh_machine(tmp_path) -> dict:
    environment = {key: value for key, value in os.environ.items() if key != GRAPH_MODE_VARIABLE}  # the real default
    return {**environment, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
            "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "COMPILED_SPEC_COMPILE_WORKERS": "1"}


def stop_background_compile(output: str) -> int:
    """Ends the compile the run left running, by the pid its last message names; returns that pid."""
    found = re.search(r"still compiling in the background \(pid (\d+), log (\S+)\.log\)", output)
    assert found, output  # the run says what it left running, and where its log is
    pid = int(found.group(1))
    try:
        os.killpg(pid, signal.SIGKILL)  # the compile leads its own session: its workers go with it
    except ProcessLookupError:
        pass
    return pid


@pytest.mark.slow
def test_first_text_comes_before_the_kernels_are_built_and_the_progress_stays_out_of_the_stream(tmp_path):
    environment = fresh_machine(tmp_path)
    command = [shutil.which("compiled-spec"), "generate", "ROMEO:", "--max-tokens", "24"]  # the README's command
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, env=environment, timeout=600)
    assert as_json.returncode == 0, as_json.stderr
    aggregate = json.loads(as_json.stdout.splitlines()[-1])["aggregate"]
    assert aggregate["graph_mode"] == "eager (full compiling in the background)", aggregate  # the default, tiered
    assert aggregate["cpu_kernels"] == "not needed", aggregate  # eager did not wait for a build
    stop_background_compile(as_json.stderr)

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
    stop_background_compile(streamed.stdout)


def aggregate_text(json_lines: str) -> str:
    return json.loads(json_lines.splitlines()[0])["text"].rstrip("\n")
