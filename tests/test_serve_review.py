"""`compiled-spec serve` against the defects a review found: request forms OpenAI clients send, strict types, errors
that do not echo huge values, tokenization off the event loop and bounded before it starts, the auth scheme, the Host
and Content-Type rules of a server without a key, HEAD and Allow, no redirects, and connections that never finish
their headers. Two live servers on 127.0.0.1 (one with a key, one without), driven by httpx, raw sockets and the
openai client."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from compiled_spec.benchmarks.live_server import free_port, running_server
from serving import serve_command, write_chat_model

REPO = Path(__file__).resolve().parents[1]
API_KEY = "review-key-123"
MAX_SEQ_LEN = 192
PROMPT_CHARACTER_LIMIT = 32 * MAX_SEQ_LEN  # docs/serving.md: 32 characters per token of the context
SERVER_ARGS = ["-k", "2", "--max-batch-size", "2", "--max-seq-len", str(MAX_SEQ_LEN), "--graph-mode", "eager",
               "--log-level", "warning", "--served-model-name", "tiny"]
HOLD = "HOLD-TOKENIZER"  # a prompt holding this waits in the tokenizer until the test releases it
PROBE = "PROBE-TOKENIZER"  # a prompt holding this leaves a file behind when it is tokenized
# `compiled-spec serve` with the tokenizer's encode instrumented: the server itself is unchanged.
INSTRUMENTED_SERVE = f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
gate, original = Path(sys.argv[1]), PreTrainedTokenizerBase.encode
def encode(self, text, *args, **kwargs):
    if isinstance(text, str) and {PROBE!r} in text:
        (gate / "probed").touch()
    if isinstance(text, str) and {HOLD!r} in text:
        (gate / "held").touch()
        deadline = time.monotonic() + 60
        while not (gate / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return original(self, text, *args, **kwargs)
PreTrainedTokenizerBase.encode = encode
from compiled_spec.cli import main
sys.argv = ["compiled-spec", *sys.argv[2:]]
main()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("review_model"))


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("review_keyed")
    with running_server(serve_command(model_dir, *SERVER_ARGS), logs / "server.log", api_key=API_KEY) as live:
        yield live


@pytest.fixture(scope="module")
def open_server(model_dir, tmp_path_factory):
    """No key (so the Host and Content-Type rules guard it), its tokenizer instrumented through live.gate."""
    logs = tmp_path_factory.mktemp("review_open")
    gate = logs / "gate"
    gate.mkdir()
    command = [sys.executable, "-c", INSTRUMENTED_SERVE, str(gate), "serve", "--model", str(model_dir),
               "--port", "{port}", *SERVER_ARGS]
    with running_server(command, logs / "server.log") as live:
        live.gate = gate
        yield live


def post(server, body, path: str = "/v1/completions", headers: dict | None = None, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    if server.api_key:
        headers.setdefault("Authorization", f"Bearer {server.api_key}")
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60, **kwargs)


def completion(server, **fields) -> httpx.Response:
    return post(server, {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, **fields})


def chat(server, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Who is Romeo?"}], "max_tokens": 4,
            "temperature": 0, **fields}
    return post(server, body, path="/v1/chat/completions")


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def assert_still_serving(server) -> None:
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    response = completion(server, max_tokens=2)
    assert response.status_code == 200, response.text


# 1. An integer literal past Python's int-string limit.

def test_an_integer_of_five_thousand_digits_is_invalid_json(open_server):
    raw = b'{"model": "tiny", "prompt": "ROMEO:", "max_tokens": ' + b"9" * 5000 + b"}"
    error = error_of(post(open_server, raw), 400)
    assert error["code"] == "invalid_json" and "digits" in error["message"]
    assert len(error["message"]) < 300
    assert_still_serving(open_server)


# 2. Tokenization runs off the event loop, and a prompt is bounded before it is tokenized.

def test_health_answers_while_a_prompt_is_being_tokenized(open_server):
    gate = open_server.gate
    result = {}

    def send():
        result["response"] = completion(open_server, prompt=f"ROMEO: {HOLD} JULIET:", max_tokens=2)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        deadline = time.monotonic() + 30
        while not (gate / "held").exists():
            assert time.monotonic() < deadline, "the prompt never reached the tokenizer"
            time.sleep(0.02)
        # The tokenizer is held: an event loop that tokenized would answer nothing until it is released.
        health = httpx.get(open_server.base_url + "/health", timeout=10)
        assert health.status_code == 200
        assert httpx.get(open_server.base_url + "/v1/models", timeout=10).status_code == 200
    finally:
        (gate / "release").touch()
        sender.join(timeout=90)
        (gate / "held").unlink(missing_ok=True)
        (gate / "release").unlink(missing_ok=True)
    assert result["response"].status_code == 200, result["response"].text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_over_the_character_bound_is_refused_before_it_is_tokenized(open_server, endpoint):
    (open_server.gate / "probed").unlink(missing_ok=True)
    text = PROBE + " ROMEO" * 40_000  # 240 KB: well under the body limit, far over the bound
    if endpoint == "completions":
        response, param = completion(open_server, prompt=text), "prompt"
    else:
        response, param = chat(open_server, messages=[{"role": "user", "content": text}]), "messages"
    error = error_of(response, 400)
    assert error["param"] == param
    assert f"{PROMPT_CHARACTER_LIMIT} characters" in error["message"], error["message"]
    assert not (open_server.gate / "probed").exists(), "the prompt was tokenized before it was refused"
    # Under the bound the prompt is tokenized (and then refused for its tokens: it is still too long).
    under = completion(open_server, prompt=PROBE + " R" * 1000)
    assert (open_server.gate / "probed").exists()
    assert error_of(under, 400)["param"] == "prompt" and "tokens" in under.json()["error"]["message"]
    assert_still_serving(open_server)


# 3. Errors do not echo huge values.

@pytest.mark.parametrize("case", ["wrong type", "unknown model", "chat role"])
def test_a_400_does_not_echo_a_huge_value(open_server, case):
    huge = "x" * 900_000
    if case == "wrong type":
        response, status = completion(open_server, max_tokens=huge), 400
    elif case == "unknown model":
        response, status = completion(open_server, model=huge), 404
    else:
        response, status = chat(open_server, messages=[{"role": huge, "content": "Hi"}]), 400  # the template's check
    error = error_of(response, status)
    assert len(response.content) < 2000, len(response.content)
    assert "…" in error["message"]
    assert_still_serving(open_server)


# 4. Request forms OpenAI clients send.

def test_chat_content_as_text_parts_equals_plain_content(keyed):
    client = keyed.client()
    question = "Who is Romeo?"
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                           max_tokens=12, temperature=0)
    parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": question}]}], max_tokens=12,
        temperature=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert caught.value.body["param"] == "messages.0.content.1.type"
    assert "image_url" in caught.value.body["message"]


def test_text_response_format_and_no_tools_are_accepted(keyed):
    client = keyed.client()
    want = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0).choices[0].message.content
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                         temperature=0, response_format={"type": "text"}, tools=[])
    assert got.choices[0].message.content == want
    for field, value, param in (("response_format", {"type": "regex"}, "response_format.type"),
                                ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tools")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           **{field: value})
        assert caught.value.body["param"] == param


def test_a_completion_prompt_of_one_string_in_a_list(keyed):
    client = keyed.client()
    want = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=8, temperature=0).choices[0].text
    got = client.completions.create(model="tiny", prompt=["ROMEO:"], max_tokens=8, temperature=0).choices[0].text
    assert got == want
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=["ROMEO:", "JULIET:"], max_tokens=4)
    assert caught.value.body["param"] == "prompt"


def test_a_model_can_be_retrieved_by_its_id(keyed):
    client = keyed.client()
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert set(caught.value.body) == {"message", "type", "param", "code"}
    assert httpx.get(keyed.base_url + "/v1/models/tiny", timeout=10).status_code == 401  # it needs the key too


# 5. Strict types.

STRICT = [({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"stream": "yes"}, "stream"),
          ({"temperature": "0.5"}, "temperature"), ({"stream_options": {"include_usage": 1}, "stream": True},
                                                    "stream_options.include_usage"),
          ({"speculation": {"num_speculative_tokens": "fast"}}, "speculation.num_speculative_tokens"),
          ({"speculation": {"num_speculative_tokens": -1}}, "speculation.num_speculative_tokens"),
          ({"speculation": {"num_speculative_tokens": 7}}, "speculation.num_speculative_tokens"),  # past the server's K
          ({"speculation": {"k": 2}}, "speculation.k")]


@pytest.mark.parametrize("fields, param", STRICT, ids=[json.dumps(f) for f, _ in STRICT])
def test_a_value_of_the_wrong_type_is_a_400_naming_its_field(open_server, fields, param):
    error = error_of(completion(open_server, **fields), 400)
    assert error["param"] == param and param in error["message"]


def test_integer_temperature_and_top_p_are_numbers(open_server):
    response = completion(open_server, temperature=1, top_p=1, seed=3)
    assert response.status_code == 200, response.text


# 6. The auth scheme is case-insensitive.

@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_auth_scheme_is_case_insensitive(keyed, scheme):
    response = httpx.get(keyed.base_url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=10)
    assert response.status_code == 200, response.text
    wrong = httpx.get(keyed.base_url + "/v1/models", headers={"Authorization": f"{scheme} nope"}, timeout=10)
    assert wrong.status_code == 401


# 7. A key that clients cannot send.

@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_non_ascii_api_key_refuses_to_start(model_dir, how):
    key = "clé-secrète"
    args = ["--api-key", key] if how == "option" else []
    env = {k: v for k, v in os.environ.items() if k != "COMPILED_SPEC_API_KEY"}
    if how == "environment":
        env["COMPILED_SPEC_API_KEY"] = key
    try:
        result = subprocess.run([sys.executable, "-m", "compiled_spec.cli", "serve", "--model", str(model_dir), "--port",
                                 str(free_port()), "--graph-mode", "eager", *args], capture_output=True, text=True,
                                timeout=60, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the server started with a key no client can send")
    assert result.returncode == 2, result.stderr
    assert "ASCII" in result.stderr and "Traceback" not in result.stderr


# 8. HEAD for the GET routes, Allow on 405.

def test_head_answers_the_get_routes(keyed):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path, headers in (("/health", {}), ("/metrics", {}), ("/v1/models", auth), ("/v1/models/tiny", auth)):
        response = httpx.head(keyed.base_url + path, headers=headers, timeout=10)
        assert response.status_code == 200, (path, response.status_code)
        assert response.content == b""


def test_a_405_says_which_methods_are_allowed(keyed):
    response = httpx.post(keyed.base_url + "/health", timeout=10)
    assert response.status_code == 405
    assert set(response.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    response = httpx.get(keyed.base_url + "/v1/completions", timeout=10)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


# 9. The schema is not open to anyone.

def test_openapi_json_is_not_served_without_the_key(keyed):
    response = httpx.get(keyed.base_url + "/openapi.json", timeout=10)
    assert response.status_code in (401, 404)
    assert "paths" not in response.text


# 10. No redirects.

@pytest.mark.parametrize("method, path", [("GET", "/health/"), ("GET", "/v1/models/"), ("POST", "/v1/completions/")])
def test_a_trailing_slash_is_a_404_not_a_redirect(open_server, method, path):
    response = httpx.request(method, open_server.base_url + path, timeout=10,
                             headers={"Content-Type": "application/json"},
                             content=b"{}" if method == "POST" else None)
    assert response.status_code == 404, (response.status_code, response.headers)
    assert "location" not in response.headers


# 11. Content-Type, and the Host of a server without a key.

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_a_415(open_server, content_type):
    body = json.dumps({"model": "tiny", "prompt": "ROMEO:", "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = httpx.post(open_server.base_url + "/v1/completions", content=body, headers=headers, timeout=30)
    error = error_of(response, 415)
    assert "application/json" in error["message"] and error["code"] == "unsupported_media_type"
    charset = post(open_server, body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert charset.status_code == 200, charset.text


def test_a_server_without_a_key_answers_only_its_own_host_names(open_server):
    port = open_server.port
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"localhost:{port + 1}"):
        for response in (httpx.get(open_server.base_url + "/v1/models", headers={"Host": host}, timeout=10),
                         httpx.get(open_server.base_url + "/health", headers={"Host": host}, timeout=10),
                         post(open_server, {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 2},
                              headers={"Host": host})):
            error = error_of(response, 421)
            assert error["code"] == "invalid_host" and "Host" in error["message"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"LocalHost:{port}", f"[::1]:{port}"):
        response = httpx.get(open_server.base_url + "/v1/models", headers={"Host": host}, timeout=10)
        assert response.status_code == 200, (host, response.text)


def test_a_server_with_a_key_answers_any_host_name(keyed):
    response = httpx.get(keyed.base_url + "/v1/models", timeout=10,
                         headers={"Host": "my-gpu-box.example:443", "Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text


def test_the_openai_client_passes_the_host_and_content_type_rules(open_server):
    client = open_server.client()
    assert client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=3, temperature=0).choices[0].text
    assert [model.id for model in client.models.list().data] == ["tiny"]


# 12. A connection that never finishes its headers is closed.

def test_a_connection_that_never_finishes_its_headers_is_closed(open_server):
    sock = socket.create_connection(("127.0.0.1", open_server.port))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-Slow: " % open_server.port)
    closed, start = False, time.monotonic()
    try:
        while time.monotonic() - start < 60:  # the documented header timeout is 10 s
            if select.select([sock], [], [], 1)[0]:
                try:
                    if not sock.recv(65536):
                        closed = True
                        break
                except ConnectionResetError:
                    closed = True
                    break
            else:
                try:
                    sock.sendall(b"a")  # one byte a second: never idle, never done
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
    finally:
        sock.close()
    assert closed, "the connection was still open after 60 s"
    assert_still_serving(open_server)
