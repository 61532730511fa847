"""The default serving path: `compiled-spec serve` with no --graph-mode on CPU starts in eager, compiles full in
the background, and switches between two steps while clients keep streaming. Every stream, before, across and after
the switch, equals the eager engine's output, and so does every response's acceptance per draft position."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from compiled_spec import LLM, SamplingParams
from compiled_spec.config import GRAPH_MODE_VARIABLE
from compiled_spec.benchmarks.live_server import running_server
from serving import serve_command, write_chat_model
from test_serve import ENGINE, K, PROMPTS, stream_completion

MAX_TOKENS = 24


@pytest.mark.slow
def test_the_default_mode_switches_to_full_under_load_and_every_stream_and_acceptance_equals_eager(tmp_path, monkeypatch):
    model = write_chat_model(tmp_path / "model")
    offline = LLM(model, graph_mode="eager", show_progress=False, **ENGINE)
    expected = {prompt: (output.text, list(output.stats.accepted_per_position)) for prompt, output in zip(
        PROMPTS, offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)))}
    assert any(sum(accepted) for _, accepted in expected.values()), "drafts should be accepted"

    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "hold_switch").touch()  # the engine stays in eager until the test has seen requests served there
    command = serve_command(model, "-k", str(K), "--max-batch-size", "4", "--max-seq-len", "192",
                            "--served-model-name", "tiny", "--log-level", "warning",
                            faults=faults)  # no --graph-mode: the default, full with a tiered start
    inductor = tmp_path / "inductor"  # nothing compiled yet
    monkeypatch.delenv(GRAPH_MODE_VARIABLE)  # the suite's conftest makes eager the default for the other tests
    with running_server(command, tmp_path / "server.log", env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)}) as live:
        def mode() -> str:
            return httpx.get(live.base_url + "/health", timeout=30).json()["graph_mode"]

        assert "compiling in the background" in mode()
        client = live.client()
        results, stop = [], threading.Event()

        def one_client(offset: int) -> None:
            index = offset
            while not stop.is_set():
                prompt = PROMPTS[index % len(PROMPTS)]
                before = mode()
                text, finish_reason, usage = stream_completion(client, prompt, MAX_TOKENS)
                results.append((prompt, before, mode(), text, usage["spec_decode"]["num_accepted_tokens_per_pos"]))
                index += 3

        with ThreadPoolExecutor(3) as pool:
            clients = [pool.submit(one_client, offset) for offset in range(3)]
            deadline = time.monotonic() + 900
            def waiting() -> bool:
                return time.monotonic() < deadline and not any(future.done() for future in clients)  # a client failed

            while len(results) < 3 and waiting():  # rounds that run wholly in eager
                time.sleep(0.5)
            (faults / "hold_switch").unlink()
            while not mode().startswith("eager, then full") and waiting():
                time.sleep(1)
            switched = len(results)
            while len(results) < switched + 6 and waiting():  # rounds that run wholly in full
                time.sleep(0.5)
            stop.set()
            for future in clients:
                future.result()
        assert mode().startswith("eager, then full from step "), mode()

    for prompt, before, after, text, accepted in results:
        assert (text, accepted) == expected[prompt], (prompt, before, after)
    in_eager = [r for r in results if "background" in r[2]]  # began and ended before the switch
    in_full = [r for r in results if r[1].startswith("eager, then full")]  # began after it
    assert in_eager and in_full, [(r[1], r[2]) for r in results]
