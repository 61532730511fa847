"""What a live server does with hostile or broken requests, clients that go away, and faults in its engine thread:
a 4xx naming the problem, never a 500 or a hang, and the next request is served as if nothing happened."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from compiled_spec.benchmarks.live_server import running_server
from serve_with_faults import SECRET
from serving import inbox, serve_command, wait_for, write_chat_model

BODY_TIMEOUT_S = 2
ABORTED = 'compiled_spec:request_success_total{finished_reason="abort",model_name="tiny"}'
RUNNING = 'compiled_spec:num_requests_running{model_name="tiny"}'
WAITING = 'compiled_spec:num_requests_waiting{model_name="tiny"}'
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("reliability_model"))


@contextmanager
def faulty_server(model_dir, logs: Path):
    """One slot (so a second request waits), no API key, faults injectable through server.faults."""
    faults = logs / "faults"
    faults.mkdir()
    command = serve_command(model_dir, "-k", "2", "--max-batch-size", "1", "--max-seq-len", "512", "--graph-mode",
                            "eager", "--log-level", "warning", "--served-model-name", "tiny", "--body-timeout",
                            str(BODY_TIMEOUT_S), "--step-log", str(logs / "steps.jsonl"), faults=faults)
    with running_server(command, logs / "server.log") as live:
        live.faults, live.step_log = faults, logs / "steps.jsonl"
        yield live


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with faulty_server(model_dir, tmp_path_factory.mktemp("reliability_logs")) as live:
        yield live


def post(server, body, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kwargs)


def completion(server, **fields) -> httpx.Response:
    return post(server, {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, **fields})


def assert_still_serving(server) -> None:
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    response = completion(server, max_tokens=3)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"]


def wait_until(server, condition, what: str) -> dict:
    """/metrics once `condition` holds of it (an event wait: see serving.wait_for)."""
    samples = {}

    def reached() -> bool:
        samples.update(server.metrics())
        return condition(samples)

    wait_for(reached, what)
    return samples


def open_request(server, body: dict) -> socket.socket:
    """A request sent over a raw socket, so the test can hang up on it whenever it likes."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


@pytest.fixture
def held_steps(server):
    """Decode steps wait while server.faults/hold exists: a request stays mid-generation while the test acts."""
    (server.faults / "hold").touch()
    yield
    (server.faults / "hold").unlink(missing_ok=True)
    server.wait_idle()


@pytest.mark.parametrize("field", ["max_tokens", "top_k"])
def test_a_huge_integer_is_a_400_naming_the_field_and_its_range(server, field):
    response = completion(server, **{field: 2**63})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert f"{field}=9223372036854775808" in error["message"] and "2147483647" in error["message"]
    assert_still_serving(server)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e308"])
def test_a_temperature_out_of_range_is_a_400(server, value):
    raw = b'{"model": "tiny", "prompt": "ROMEO:", "max_tokens": 4, "temperature": %s}' % value.encode()
    response = post(server, raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "temperature"
    assert "allowed: a number in 0..100" in response.json()["error"]["message"]


def test_half_a_surrogate_pair_is_invalid_json(server):
    response = post(server, b'{"model": "tiny", "prompt": "\\ud800ROMEO", "max_tokens": 4}')
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json" and "\\ud800" in response.json()["error"]["message"]
    assert_still_serving(server)


def test_a_vanishing_temperature_decodes_greedily(server):
    greedy = completion(server, max_tokens=12, ignore_eos=True).json()["choices"][0]["text"]
    tiny = completion(server, max_tokens=12, ignore_eos=True, temperature=1e-40, seed=3)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy


def test_stop_strings_past_the_caps_are_a_400_and_nobody_else_waits(server):
    reference = completion(server, max_tokens=40, ignore_eos=True).json()["choices"][0]["text"]
    streamed = []

    def stream():
        body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])

    other = threading.Thread(target=stream)
    other.start()
    for stop, cap in ((["x%d" % i for i in range(1000)], "at most 16"), (["y" * 200_000], "at most 256")):
        response = completion(server, stop=stop)
        assert response.status_code == 400, response.text[:200]
        error = response.json()["error"]
        assert error["param"] == "stop" and cap in error["message"], error
        assert len(error["message"]) < 200  # the strings are not echoed back
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    other.join(timeout=60)
    assert "".join(streamed) == reference


@pytest.mark.parametrize("where", ["body", "field"])
def test_deeply_nested_json_is_invalid_json(server, where):
    nested = b"[" * 100_000 + b"]" * 100_000
    raw = nested if where == "body" else b'{"model": "tiny", "prompt": ' + nested + b"}"
    response = post(server, raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"
    assert "nested too deeply (allowed: fewer than" in response.json()["error"]["message"]
    assert_still_serving(server)


def test_a_chat_template_that_raises_is_a_400_on_messages(server):
    response = post(server, {"model": "tiny", "messages": [{"role": "assistant", "content": "Hello"}],
                             "max_tokens": 4}, path="/v1/chat/completions")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "must not open with the assistant" in error["message"]
    assert_still_serving(server)


def test_a_client_that_hangs_up_mid_generation_is_aborted(server, held_steps):
    before = server.metrics()
    aborts = len(inbox(server.faults, "abort"))
    sock = open_request(server, {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True})
    wait_for(lambda: (server.faults / "held").exists(), "the request held mid-generation")
    sock.close()
    wait_for(lambda: len(inbox(server.faults, "abort")) == aborts + 1, "the hang-up handed to the engine")
    (server.faults / "hold").unlink()
    wait_until(server, lambda m: m.get(ABORTED, 0) == before.get(ABORTED, 0) + 1 and m[RUNNING] == 0,
               "the abort counted and the slot freed")


def test_a_client_that_hangs_up_while_queued_is_never_prefilled(server, held_steps):
    before = server.metrics()
    aborts, added = len(inbox(server.faults, "abort")), len(inbox(server.faults, "add"))
    steps_before = len(server.step_log.read_text().splitlines())
    body = {"model": "tiny", "prompt": "JULIET:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()  # (kept: a generator closed by the garbage collector would hang up)
        next(lines)  # it holds the only slot, held mid-generation
        queued = open_request(server, {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 400})
        wait_for(lambda: len(inbox(server.faults, "add")) == added + 2, "the second request handed to the engine")
        queued.close()
        wait_for(lambda: len(inbox(server.faults, "abort")) == aborts + 1, "the queued request's hang-up")
    wait_for(lambda: len(inbox(server.faults, "abort")) == aborts + 2, "the streaming request's hang-up")
    (server.faults / "hold").unlink()
    wait_until(server, lambda m: m.get(ABORTED, 0) == before.get(ABORTED, 0) + 2 and m[RUNNING] == 0
               and m[WAITING] == 0, "both requests aborted")
    lanes = {index for line in server.step_log.read_text().splitlines()[steps_before:]
             for index in json.loads(line)["lanes"]}
    assert len(lanes) == 1  # only the streaming request ever decoded


def test_a_chunked_body_over_the_limit_is_a_413(server):
    def chunks():
        for _ in range(20):
            yield b"x" * 65536

    response = httpx.post(server.base_url + "/v1/completions", content=chunks(), timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert_still_serving(server)


def test_a_body_sent_a_byte_at_a_time_times_out(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    answer, start = b"", time.monotonic()
    try:
        while time.monotonic() - start < 60 and b"\r\n\r\n" not in answer:  # the 408 ends it
            if select.select([sock], [], [], 0.5)[0]:
                piece = sock.recv(65536)
                if not piece:
                    break
                answer += piece
            else:
                sock.sendall(b" ")
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert_still_serving(server)


def server_log_has(server, text: str) -> bool:
    wait_for(lambda: text in server.log.read_text(), f"{text!r} in the server's log")
    return True


def test_a_fault_in_a_decode_step_fails_its_requests_with_an_id_and_the_server_goes_on(server):
    (server.faults / "step").touch()
    response = completion(server, max_tokens=20, ignore_eos=True)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert SECRET not in error["message"] and "injected" not in error["message"]
    request_id = error["message"].split("request id ")[1].split()[0]
    assert server_log_has(server, request_id) and server_log_has(server, SECRET)
    assert_still_serving(server)

    (server.faults / "step").touch()
    body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 20, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "error" in events[-1] and SECRET not in events[-1]["error"]["message"]
    assert_still_serving(server)


def test_a_fault_in_the_background_compile_poll_neither_kills_nor_hangs_the_server(server):
    (server.faults / "poll").touch()  # fires in the idle poll after this request ends at its first token
    assert completion(server, max_tokens=1).status_code == 200
    wait_for(lambda: not (server.faults / "poll").exists(), "the idle poll")  # the loop polls just after it answered
    assert_still_serving(server)

    (server.faults / "poll").touch()  # fires in the poll of the next decode step
    response = completion(server, max_tokens=20, ignore_eos=True)
    assert response.status_code == 500 and SECRET not in response.text
    assert_still_serving(server)


def test_an_engine_thread_that_dies_answers_everyone_and_health_says_so(model_dir, tmp_path):
    with faulty_server(model_dir, tmp_path) as server:
        (server.faults / "die").touch()
        response = completion(server, max_tokens=20, ignore_eos=True)
        assert response.status_code == 500 and SECRET not in response.text
        health = httpx.get(server.base_url + "/health", timeout=10)
        assert health.status_code == 503 and "engine loop has stopped" in health.text
        later = completion(server)  # answered at once, not left waiting for a thread that is gone
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_stopped"


def test_an_empty_api_key_refuses_to_start(model_dir):
    for args, env in (([ "--api-key", ""], {}), ([], {"COMPILED_SPEC_API_KEY": ""})):
        result = subprocess.run([sys.executable, "-m", "compiled_spec.cli", "serve", "--model", str(model_dir), *args],
                                capture_output=True, text=True, timeout=120, cwd=REPO, env={**_env(), **env})
        assert result.returncode == 2, result.stderr
        assert "api-key" in result.stderr and "empty" in result.stderr and "Traceback" not in result.stderr


def test_serving_every_address_without_a_key_warns(tmp_path):
    result = subprocess.run([sys.executable, "-m", "compiled_spec.cli", "serve", "--host", "0.0.0.0", "--model",
                             str(tmp_path / "no-such-model")], capture_output=True, text=True, timeout=120,
                            cwd=REPO, env=_env())
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "0.0.0.0 without --api-key" in warnings[0], result.stderr
    assert result.returncode == 2  # the model does not exist: the warning came before anything was loaded


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "COMPILED_SPEC_API_KEY"}
