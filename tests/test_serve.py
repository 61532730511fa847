"""`compiled-spec serve`, live in a subprocess on 127.0.0.1, driven by the official openai client; every
output is compared with LLM.generate / LLM.chat on the same checkpoint in this process."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from compiled_spec import LLM, CompiledSpecError, SamplingParams
from compiled_spec.api import DEFAULT_MODEL
from compiled_spec.chat import chat_prompt
from compiled_spec.benchmarks.live_server import running_server
from serving import inbox, serve_command, wait_for, write_chat_model

K = 2
# serve's defaults: logprobs up to 20, structured output on
ENGINE = dict(num_speculative_tokens=K, max_batch_size=4, max_seq_len=192, max_logprobs=20, structured_output=True)
SERVER_ARGS = ["-k", str(K), "--max-batch-size", "4", "--max-seq-len", "192", "--graph-mode", "eager",
               "--log-level", "warning"]
API_KEY = "test-key-123"
PROMPTS = ["ROMEO: But soft", "JULIET:", "def fib(n):", "It is the east, and", "O Romeo, Romeo, wherefore",
           "Deny thy father", "return n if", "what light through yonder window breaks? It is"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("serve_model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The server, with the test hooks of serve_with_faults.py in server.faults."""
    logs = tmp_path_factory.mktemp("serve_logs")
    (logs / "faults").mkdir()
    command = serve_command(model_dir, *SERVER_ARGS, "--step-log", str(logs / "steps.jsonl"),
                            "--served-model-name", "tiny", faults=logs / "faults")
    with running_server(command, logs / "server.log", api_key=API_KEY) as live:
        live.step_log, live.faults = logs / "steps.jsonl", logs / "faults"
        yield live


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, graph_mode="eager", show_progress=False, **ENGINE)


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def stream_completion(client, prompt: str, max_tokens: int, **extra) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one streamed completion."""
    text, finish_reason, usage = "", None, None
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, **extra):
        if chunk.choices:
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return text, finish_reason, usage


def test_completions_equal_generate_streamed_and_not(server, offline):
    client = server.client()
    stops = ["\n"]
    expected = offline.generate(PROMPTS[:3], [greedy(24), greedy(24, stop=stops), greedy(24, ignore_eos=True)])
    whole = [client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0),
             client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stops),
             client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})]
    streamed = [stream_completion(client, PROMPTS[0], 24), stream_completion(client, PROMPTS[1], 24, stop=stops),
                stream_completion(client, PROMPTS[2], 24, extra_body={"ignore_eos": True})]
    for want, got, (text, finish_reason, usage) in zip(expected, whole, streamed):
        assert got.choices[0].text == want.text == text
        assert got.choices[0].finish_reason == want.finish_reason == finish_reason
        assert got.usage.completion_tokens == len(want.token_ids) == usage["completion_tokens"]
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        spec = got.usage.model_extra["spec_decode"]
        assert spec["num_accepted_tokens_per_pos"] == want.stats.accepted_per_position
        assert spec["mean_accepted_length"] == pytest.approx(want.stats.mean_accepted_length)
        assert usage["spec_decode"] == spec
    assert expected[2].finish_reason == "length" and len(expected[2].token_ids) == 24
    assert sum(expected[2].stats.accepted_per_position) > 0, "the MTP modules should have drafts accepted"


def test_chat_completions_equal_llm_chat(server, offline):
    client = server.client()
    messages = [{"role": "system", "content": "You are Juliet."}, {"role": "user", "content": "Who is Romeo?"}]
    want = offline.chat(messages, greedy(20, ignore_eos=True))[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    pieces, roles = [], []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=20,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            roles.append(chunk.choices[0].delta.role)
    assert "".join(pieces) == want.text
    assert roles[0] == "assistant"


def test_seeded_sampling_equals_generate(server, offline):
    client = server.client()
    want = offline.generate(PROMPTS[3], SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=11))[0]
    got = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=0.9, top_p=0.9,
                                    seed=11)
    assert got.choices[0].text == want.text


def test_logprobs_of_sampled_tokens_under_speculation_equal_the_engines_streamed_and_not(server, offline):
    """Chat's logprobs and top_logprobs, the completions' logprobs: N, in OpenAI's shapes as the client parses them."""
    client = server.client()
    messages = [{"role": "user", "content": "Who is Juliet?"}]
    want = offline.chat(messages, SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True,
                                                 logprobs=3))[0]
    assert want.stats.accepted > 0  # accepted drafts among the tokens
    ask = dict(model="tiny", messages=messages, max_tokens=20, temperature=0.9, seed=5, logprobs=True, top_logprobs=3,
               extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(**ask, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    text = offline.tokenizer.decode
    for content in (whole, streamed):
        assert [entry.token for entry in content] == [text([e.token_id]) for e in want.logprobs]
        assert [entry.logprob for entry in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
        for entry, expected in zip(content, want.logprobs, strict=True):
            assert [top.token for top in entry.top_logprobs] == [text([i]) for i, _ in expected.top_logprobs]
            assert [top.logprob for top in entry.top_logprobs] == pytest.approx(
                [lp for _, lp in expected.top_logprobs], abs=1e-6)
    # Each token's own bytes: a token that holds part of a character has no text of its own, but its bytes join
    assert b"".join(bytes(entry.bytes) for entry in whole).decode(errors="replace") == want.text
    assert any("\ufffd" in entry.token for entry in whole)  # this test's sampled text has such tokens

    want = offline.generate(PROMPTS[0], greedy(16, ignore_eos=True, logprobs=2))[0]
    ask = dict(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=2,
               extra_body={"ignore_eos": True})
    whole = client.completions.create(**ask).choices[0].logprobs
    pieces = [chunk.choices[0].logprobs for chunk in client.completions.create(**ask, stream=True)
              if chunk.choices and chunk.choices[0].logprobs]
    streamed = {name: [value for piece in pieces for value in getattr(piece, name)]
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for got in (whole.model_dump(), streamed):
        assert got["tokens"] == [text([e.token_id]) for e in want.logprobs]
        assert got["token_logprobs"] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
        # a dict by token text, as OpenAI's legacy shape is: tokens of one text (two halves of characters) share a key
        assert [list(top) for top in got["top_logprobs"]] == [list({text([i]): 0 for i, _ in e.top_logprobs})
                                                               for e in want.logprobs]
        assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(len(got["tokens"]))]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)
    assert caught.value.body["param"] == "top_logprobs" and "needs logprobs=true" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, logprobs=True, top_logprobs=21)
    assert caught.value.body["param"] == "top_logprobs"
    assert caught.value.body["message"].startswith("top_logprobs=21 is invalid; allowed: an integer in 0..20")


def test_n_choices_each_equal_a_request_with_its_seed_streamed_and_not(server, offline):
    client = server.client()
    messages = [{"role": "user", "content": "Who is Romeo?"}]
    want = [offline.chat(messages, SamplingParams(temperature=0.9, seed=21 + i, max_tokens=12, ignore_eos=True))[0]
            for i in range(3)]
    assert len({w.text for w in want}) > 1
    ask = dict(model="tiny", messages=messages, max_tokens=12, temperature=0.9, seed=21, n=3,
               extra_body={"ignore_eos": True})
    got = client.chat.completions.create(**ask)
    assert [choice.index for choice in got.choices] == [0, 1, 2]
    assert [choice.message.content for choice in got.choices] == [w.text for w in want]
    assert got.usage.prompt_tokens == len(want[0].prompt_token_ids)  # the prompt once: its prefill ran once
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert got.usage.model_extra["spec_decode"]["num_drafts"] == sum(w.stats.steps for w in want)
    texts, finished = ["", "", ""], [None] * 3
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == [w.text for w in want] and finished == ["length"] * 3
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0.9, seed=3, n=2,
                                      logprobs=1)
    for index, choice in enumerate(whole.choices):
        single = offline.generate(PROMPTS[1], SamplingParams(temperature=0.9, seed=3 + index, max_tokens=8,
                                                             logprobs=1))[0]
        assert choice.text == single.text
        assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in single.logprobs], abs=1e-5)


ACT = {"type": "object", "properties": {"who": {"enum": ["romeo", "juliet", "tybalt"]},
                                         "act": {"type": "integer", "minimum": 1, "maximum": 5}},
       "required": ["who", "act"]}


def test_response_format_json_schema_and_json_object_equal_the_engines_streamed_and_not(server, offline):
    client = server.client()
    messages = [{"role": "user", "content": "Who is Romeo?"}]
    want = offline.chat(messages, greedy(64, json_schema=ACT))[0]
    assert want.finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), ACT)
    response_format = {"type": "json_schema", "json_schema": {"name": "act", "schema": ACT, "strict": True}}
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0,
                                         response_format=response_format)
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=64, temperature=0, response_format=response_format, stream=True)
        if chunk.choices)
    assert streamed == want.text
    # json_object on the completions endpoint (vLLM's extension there), sampled: any JSON object, as generate gives.
    anything = offline.generate(PROMPTS[0], SamplingParams(temperature=0.9, seed=4, max_tokens=24, json_schema=True))
    completion = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0.9, seed=4,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert completion.choices[0].text == anything[0].text and anything[0].text.startswith("{")


def test_sixteen_concurrent_streams_join_running_batches_and_lose_nothing(server, offline):
    client = server.client()
    jobs = [(PROMPTS[i % len(PROMPTS)] * (1 + i % 3), 6 + (i * 7) % 40) for i in range(16)]
    expected = offline.generate([prompt for prompt, _ in jobs],
                                [greedy(max_tokens, ignore_eos=True) for _, max_tokens in jobs])
    steps_before = len(server.step_log.read_text().splitlines())
    added_before = len(inbox(server.faults, "add"))
    (server.faults / "hold").touch()  # the first step waits until all 16 have been handed to the engine
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_completion, client, prompt, max_tokens, extra_body={"ignore_eos": True})
                   for prompt, max_tokens in jobs]
        wait_for(lambda: len(inbox(server.faults, "add")) == added_before + 16 and (server.faults / "held").exists(),
                 "16 requests handed to an engine held at its first step")
        (server.faults / "hold").unlink()
        results = [future.result() for future in futures]
    for (text, finish_reason, usage), want, (_, max_tokens) in zip(results, expected, jobs):
        assert text == want.text
        assert usage["completion_tokens"] == len(want.token_ids) == max_tokens
        assert finish_reason == "length"

    steps = [json.loads(line)["lanes"] for line in server.step_log.read_text().splitlines()[steps_before:]]
    assert max(len(lanes) for lanes in steps) == 4  # the batch filled up
    first_step = {}
    for number, lanes in enumerate(steps):
        for request in lanes:
            first_step.setdefault(request, number)
    joined = [request for request, number in first_step.items() if number > 0
              and set(steps[number - 1]) & set(steps[number]) - {request}]
    assert len(first_step) == 16
    assert joined, "no request joined a batch that was already decoding"


def test_a_client_that_disconnects_frees_its_slot(server, offline):
    client = server.client()
    before = server.metrics()
    abort_key = 'compiled_spec:request_success_total{finished_reason="abort",model_name="tiny"}'
    other = {}
    thread = threading.Thread(target=lambda: other.update(result=stream_completion(
        client, PROMPTS[4], 60, extra_body={"ignore_eos": True})))
    body = {"model": "tiny", "prompt": PROMPTS[5], "max_tokens": 180, "temperature": 0, "stream": True,
            "ignore_eos": True}
    aborts_before = len(inbox(server.faults, "abort"))
    (server.faults / "hold").touch()  # the request stays mid-generation until its hang-up reached the engine
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        thread.start()
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the prefill's token
    wait_for(lambda: len(inbox(server.faults, "abort")) == aborts_before + 1, "the hang-up handed to the engine")
    (server.faults / "hold").unlink()
    thread.join()
    server.wait_idle()
    after = server.metrics()
    assert after.get(abort_key, 0) == before.get(abort_key, 0) + 1
    generated = 'compiled_spec:generation_tokens_total{model_name="tiny"}'
    # The aborted request made its prefill's token and at most one step's (the held one): the other made 60.
    assert after[generated] - before[generated] <= 60 + 1 + (K + 1)
    want = offline.generate(PROMPTS[4], greedy(60, ignore_eos=True))[0]
    assert other["result"][0] == want.text


BAD_COMPLETIONS = [
    (dict(temperature=-1), 400, "temperature"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(top_p=7), 400, "top_p"),
    (dict(model="no-such-model"), 404, "model"),
    (dict(prompt="ROMEO: " * 400), 400, "prompt"),
    (dict(n=5), 400, "n"),  # past the server's 4 slots
    (dict(logprobs=21), 400, "logprobs"),
    (dict(extra_body={"response_format": {"type": "yaml"}}), 400, "response_format.type"),
    (dict(extra_body={"response_format": {"type": "json_schema"}}), 400, "response_format.json_schema"),
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objekt"}}}}), 400, "response_format"),
    (dict(extra_body={"best_temperature": 1}), 400, "best_temperature"),
]


@pytest.mark.parametrize("change, status, param", BAD_COMPLETIONS, ids=[p for _, _, p in BAD_COMPLETIONS])
def test_a_bad_request_names_its_field_and_the_server_keeps_serving(server, change, status, param):
    client = server.client()
    request = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 4, **change}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**request)
    assert caught.value.status_code == status
    error = caught.value.body
    assert error["param"] == param
    assert param in error["message"] or param == "prompt" and "too long" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=3, temperature=0).choices[0].text


def test_malformed_json_and_keys_get_openai_errors(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    response = httpx.post(server.base_url + "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.AuthenticationError) as caught:
        server.client(api_key="wrong-key").completions.create(model="tiny", prompt="ROMEO:", max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    missing = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "ROMEO:"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert [m.id for m in server.client().models.list().data] == ["tiny"]
    assert httpx.get(server.base_url + "/health").status_code == 200  # health and metrics need no key
    huge = b'{"model": "tiny", "prompt": "' + b"a" * (2 << 20) + b'"}'
    assert httpx.post(server.base_url + "/v1/completions", content=huge, headers=headers).status_code == 413
    assert server.client().completions.create(model="tiny", prompt="ROMEO:", max_tokens=2).choices


def test_metrics_counters_agree_with_the_responses(server):
    client = server.client()
    server.wait_idle()
    before = server.metrics()
    ks = [0, 1, "auto", None]  # per request (the extension field); auto and left out: the server's k
    usages = [client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={
        "ignore_eos": True, **({"speculation": {"num_speculative_tokens": k}} if k is not None else {})}
    ).usage.model_dump() for prompt, k in zip(PROMPTS[:4], ks)]
    server.wait_idle()
    after = server.metrics()
    for usage, k in zip(usages, ks):  # every step of a request drafted its own k
        assert list(usage["spec_decode"]["num_steps_per_num_drafts"]) == [str(K if k in ("auto", None) else k)]
    assert usages[0]["spec_decode"]["num_draft_tokens"] == 0 < usages[1]["spec_decode"]["num_draft_tokens"]

    def delta(name: str) -> float:
        key = f"compiled_spec:{name}"
        return after.get(key, 0) - before.get(key, 0)

    label = '{model_name="tiny"}'
    spec = [usage["spec_decode"] for usage in usages]
    assert delta(f"spec_decode_num_drafts_total{label}") == sum(s["num_drafts"] for s in spec) > 0
    assert delta(f"spec_decode_num_draft_tokens_total{label}") == sum(s["num_draft_tokens"] for s in spec)
    assert delta(f"spec_decode_num_accepted_tokens_total{label}") == sum(s["num_accepted_tokens"] for s in spec)
    mtp = '{drafter="mtp",model_name="tiny"}'
    assert delta(f"spec_decode_num_draft_tokens_per_drafter_total{mtp}") == sum(s["num_draft_tokens"] for s in spec)
    assert delta(f"spec_decode_num_accepted_tokens_per_drafter_total{mtp}") == sum(s["num_accepted_tokens"] for s in spec)
    for position in range(K):
        name = f'spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{position}"}}'
        assert delta(name) == sum(s["num_accepted_tokens_per_pos"][position] for s in spec)
    for k in range(K + 1):
        name = f'spec_decode_num_steps_per_num_drafts_total{{model_name="tiny",num_drafts="{k}"}}'
        assert delta(name) == sum(s["num_steps_per_num_drafts"].get(str(k), 0) for s in spec) > 0
    assert delta(f"generation_tokens_total{label}") == sum(u["completion_tokens"] for u in usages) == 48
    assert delta(f"prompt_tokens_total{label}") == sum(u["prompt_tokens"] for u in usages)
    assert delta(f"time_to_first_token_seconds_count{label}") == 4
    assert after[f"compiled_spec:graph_divergence_total{label}"] == 0  # the canary's count (serve checks graphs)
    assert delta(f"e2e_request_latency_seconds_count{label}") == 4
    assert delta(f"inter_token_latency_seconds_count{label}") >= 4


def test_an_ngram_server_gives_the_same_text_and_counts_drafts_by_drafter(tmp_path):
    """--drafter ngram on the embedded model, which has MTP modules: greedy text equals the MTP engine's, drafts come
    from the request's own tokens, and /metrics counts them under drafter="ngram" as the responses' usage does."""
    command = serve_command(DEFAULT_MODEL, *SERVER_ARGS, "--drafter", "ngram", "--served-model-name", "tiny")
    prompts = ["ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\nAy me!\nROMEO:\n",
               "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\nFirst Citizen:\n"]
    with running_server(command, tmp_path / "server.log") as live:
        client = live.client()
        before = live.metrics()
        responses = [client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                               extra_body={"ignore_eos": True}) for prompt in prompts]
        live.wait_idle()
        after = live.metrics()
    mtp = LLM(DEFAULT_MODEL, graph_mode="eager", show_progress=False, **ENGINE)
    assert [r.choices[0].text for r in responses] == [o.text for o in mtp.generate(prompts, greedy(32, ignore_eos=True))]
    spec = [r.usage.model_dump()["spec_decode"] for r in responses]

    def delta(name: str) -> float:
        return after.get(f"compiled_spec:{name}", 0) - before.get(f"compiled_spec:{name}", 0)

    ngram = '{drafter="ngram",model_name="tiny"}'
    assert delta(f"spec_decode_num_draft_tokens_per_drafter_total{ngram}") == sum(s["num_draft_tokens"] for s in spec) > 0
    assert delta(f"spec_decode_num_accepted_tokens_per_drafter_total{ngram}") == sum(
        s["num_accepted_tokens"] for s in spec) > 0
    assert not any('drafter="mtp"' in name for name in after)


def test_a_tree_servers_step_counters_equal_the_responses_of_requests_batched_together(model_dir, tmp_path):
    """--draft-tree 2,2, four requests at once (they share steps): steps by k, tree steps and steps that ended on a
    leaf count per request, as each response's usage does."""
    command = serve_command(model_dir, *SERVER_ARGS, "--draft-tree", "2,2", "--served-model-name", "tiny")
    with running_server(command, tmp_path / "server.log") as live:
        client = live.client()
        before = live.metrics()

        def usage(prompt):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True}).usage.model_dump()["spec_decode"]

        with ThreadPoolExecutor(4) as pool:
            spec = list(pool.map(usage, PROMPTS[:4]))
        live.wait_idle()
        after = live.metrics()
    label = '{model_name="tiny"}'
    names = {"num_tree_steps": f"compiled_spec:spec_decode_num_tree_steps_total{label}",
             "num_leaf_steps": f"compiled_spec:spec_decode_num_leaf_steps_total{label}",
             "num_drafts": f"compiled_spec:spec_decode_num_drafts_total{label}"}
    for field, name in names.items():
        assert after[name] - before.get(name, 0) == sum(s[field] for s in spec)
    steps_at_2 = 'compiled_spec:spec_decode_num_steps_per_num_drafts_total{model_name="tiny",num_drafts="2"}'
    assert after[steps_at_2] - before.get(steps_at_2, 0) == sum(s["num_steps_per_num_drafts"]["2"] for s in spec)
    assert all(s["num_tree_steps"] == s["num_drafts"] for s in spec)
    assert sum(s["num_leaf_steps"] for s in spec) > 0


def test_a_full_queue_gets_429_and_sigterm_finishes_what_runs(model_dir, tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    command = serve_command(model_dir, *SERVER_ARGS[:2], "--max-batch-size", "1", "--max-queue", "1",
                            "--max-seq-len", "512", "--served-model-name", "tiny", "--log-level", "warning",
                            faults=faults)
    with running_server(command, tmp_path / "server.log") as live:
        client = live.client()
        (faults / "hold").touch()  # the first request stays running until SIGTERM
        first = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=400, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
        first_chunks = iter(first)
        next(first_chunks)  # the first request runs (the only slot) ...
        second = client.completions.create(model="tiny", prompt="JULIET:", max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        wait_for(lambda: len(inbox(faults, "add")) == 2, "the second request handed to the engine")
        with pytest.raises(openai.RateLimitError) as caught:  # ... the second waits, the third finds the queue full
            client.completions.create(model="tiny", prompt="O Romeo", max_tokens=4)
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["code"] == "queue_full"

        live.process.send_signal(signal.SIGTERM)
        (faults / "hold").unlink()
        finish_reasons = [chunk.choices[0].finish_reason for chunk in first_chunks if chunk.choices]
        second_reasons = [chunk.choices[0].finish_reason for chunk in second if chunk.choices]
        assert finish_reasons[-1] == "length" and second_reasons[-1] == "length"
        assert live.process.wait(timeout=60) == 0


def test_chat_without_a_template_is_a_clear_error(offline):
    with pytest.raises(CompiledSpecError, match="no chat template") as caught:
        chat_prompt(None, [{"role": "user", "content": "hi"}])
    assert caught.value.param == "messages"
    with pytest.raises(CompiledSpecError, match=r"messages\[0\]"):
        chat_prompt(offline.tokenizer, [{"role": "wizard", "content": "hi"}])


def test_the_serve_benchmark_runs_its_levels_without_errors(model_dir, tmp_path):
    from compiled_spec.benchmarks.serve import main, rss_leaks

    main(["--model", str(model_dir), "-k", "2", "--graph-mode", "eager", "--concurrency", "3,3,3", "--duration", "2",
          "--max-tokens", "8", "--max-batch-size", "2", "--max-seq-len", "64", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "serve.json").read_text())
    ours, llama_cpp = results["servers"]
    assert [level["concurrency"] for level in ours["levels"]] == [3, 3, 3]
    # RSS stays flat after the first level (main would have exited 1), and the same check fires where it must not.
    assert ours["rss_growth_mib_per_level"] <= 5 and rss_leaks(results, 5) == []
    assert rss_leaks(results, ours["rss_growth_mib_per_level"] - 0.01)
    assert "MiB per level after the first" in (tmp_path / "serve.md").read_text()
    for level in ours["levels"]:
        assert level["errors"] == 0 and level["requests"] > 0
        assert level["output_tokens"] == 8 * level["requests"]
        assert len(level["acceptance_rate_per_position"]) == 2 and level["ttft_ms"]["p50"] > 0
        assert 50 < ours["rss_mib_after_warm_up"] and 50 < level["rss_mib_at_end"] < 8192  # the server's own MiB
    assert "RSS MiB after warm-up / at end" in (tmp_path / "serve.md").read_text()
    assert llama_cpp["skipped"].startswith("no --llama-cpp-gguf")
    assert "| compiled-spec (k=2, eager) | 3 |" in (tmp_path / "serve.md").read_text()
