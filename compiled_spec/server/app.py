"""The HTTP side of `compiled-spec serve`: OpenAI-compatible routes over one EngineLoop.

Handlers run on uvicorn's event loop and never touch the engine: they check a request, have it tokenized on the
server's tokenizer thread (its own copy of the tokenizer; the loop streams text with a second copy, the engine
thread decodes with the model's), submit it, and relay its events.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import ipaddress
import itertools
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..api import LLM
from ..chat import chat_prompt
from ..errors import CompiledSpecError
from ..params import RequestOutput
from ..detokenizer import TextStream, TokenPieces
from .engine_loop import EngineLoop, Pending, QueueFull, ShuttingDown
from .metrics import ServerMetrics
from .protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, PROMPT_CHARACTERS_PER_TOKEN, APIError, ChatCompletionRequest,
                       CompletionRequest, ResponseShape, new_id, parse, shown, wire_error)

log = logging.getLogger("compiled_spec.server")


@dataclass
class ServerOptions:
    model_name: str
    api_key: str | None = None
    max_queue: int = 64
    max_request_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # to receive a whole request body
    retry_after_s: int = 1
    step_log: str | None = None


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be the API key, or None. Clients send header values as ASCII (the openai client and
    httpx refuse anything else), so a key with other characters could never match."""
    if not key.strip():
        return "is empty; give a non-empty key, or none to serve without one"
    if not all("!" <= character <= "~" for character in key):
        return ("must be printable ASCII without spaces (the characters '!' to '~'): HTTP clients send header "
                "values as ASCII, so a key with other characters could never be sent")
    return None


def create_app(llm: LLM, options: ServerOptions) -> FastAPI:
    if llm.tokenizer is None:
        raise CompiledSpecError(f"serve needs a model with a tokenizer; {str(llm.path)!r} has none")
    if options.api_key is not None and (problem := api_key_problem(options.api_key)):
        raise CompiledSpecError(f"the API key {problem}")
    metrics = ServerMetrics(options.model_name, llm.draft_slots, llm.config.drafter)
    loop = EngineLoop(llm.engine, metrics, options.max_queue, options.step_log)
    tokenizer = copy.deepcopy(llm.tokenizer)  # the event loop's: streamed text
    pieces = TokenPieces(tokenizer)  # and logprobs' tokens
    # Prompts are rendered and tokenized on one thread of their own with a copy of the tokenizer used nowhere else
    # (a fast tokenizer is not safe to share between threads): a long prompt never stalls the event loop.
    encoder = copy.deepcopy(llm.tokenizer)
    tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compiled-spec-tokenize")
    max_prompt_characters = PROMPT_CHARACTERS_PER_TOKEN * llm.config.max_seq_len
    request_numbers = itertools.count()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        await asyncio.to_thread(loop.wait_ready)
        yield
        loop.stop()  # uvicorn has let in-flight responses finish (or cut them at its timeout); abort the rest
        tokenize_thread.shutdown(wait=False, cancel_futures=True)

    # No /openapi.json (nor docs): the schema would be open to anyone, key or not, and says nothing the docs do not.
    # No redirects for a trailing slash: they would point at a URL built from the client's Host header.
    app = FastAPI(title="compiled-spec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.engine_loop = loop
    if options.api_key is None:
        app.add_middleware(LocalHostOnly)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(APIError(error.status_code, str(error.detail), code=code).body(),
                            status_code=error.status_code, headers=error.headers)  # a 405's Allow

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return JSONResponse(APIError(400, str(error)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        request_id = new_id("req")
        log.error("request %s (%s %s) failed", request_id, request.method, request.url.path, exc_info=error)
        return JSONResponse(internal_error_body(request_id), status_code=500)

    def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").strip().partition(" ")
        given = credentials.strip() if scheme.lower() == "bearer" else ""  # the scheme is case-insensitive (RFC 7235)
        if not hmac.compare_digest(given.encode(), options.api_key.encode()):
            raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > options.max_request_bytes:
                raise APIError(413, f"request body is over the limit of {options.max_request_bytes} bytes",
                               code="request_too_large", headers={"Connection": "close"})
        return bytes(body)

    async def read_json(request: Request):
        content_type = request.headers.get("content-type")
        if content_type is None or content_type.split(";", 1)[0].strip().lower() != "application/json":
            # Also what keeps a web page from posting here without a CORS preflight (a form or text/plain).
            got = f"got {shown(content_type)}" if content_type is not None else "got none"
            raise APIError(415, f"the request body must be sent with 'Content-Type: application/json' ({got})",
                           code="unsupported_media_type")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > options.max_request_bytes:
            raise APIError(413, f"request body of {declared} bytes is over the limit of "
                                f"{options.max_request_bytes} bytes", code="request_too_large")
        try:
            body = await asyncio.wait_for(read_body(request), options.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {options.body_timeout_s:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, f"the request body is not valid JSON: it is nested too deeply (allowed: fewer "
                                f"than {sys.getrecursionlimit()} levels)", code="invalid_json") from None
        except ValueError:  # an integer past Python's int-string limit (json's own errors are caught above)
            raise APIError(400, f"the request body has an integer too long to read (allowed: up to "
                                f"{sys.get_int_max_str_digits()} digits)", code="invalid_json") from None
        try:  # JSON may escape half a UTF-16 pair ("\\ud800"): no text, and the tokenizer cannot take it
            json.dumps(parsed, ensure_ascii=False).encode()
        except UnicodeEncodeError as error:
            raise APIError(400, f"the request body has a string that is not valid Unicode ({error.reason}: "
                                f"{error.object[error.start:error.end]!a})", code="invalid_json") from None
        return parsed

    def check_model(name: str) -> None:
        if name != options.model_name:
            raise APIError(404, f"model {shown(name)} does not exist; this server serves {options.model_name!r}",
                           param="model", code="model_not_found")

    def check_characters(characters: int, param: str) -> None:
        if characters > max_prompt_characters:
            raise APIError(400, f"the prompt has {characters} characters; allowed: at most {max_prompt_characters} "
                                f"characters ({PROMPT_CHARACTERS_PER_TOKEN} per token of the {llm.config.max_seq_len}"
                                f"-token context), checked before tokenizing", param=param,
                           code="context_length_exceeded")

    async def off_the_loop(function, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenize_thread, function, *args)

    def encode(text: str) -> list[int]:  # on the tokenizer thread only
        return encoder.encode(text, add_special_tokens=False)

    def encode_chat(conversation: list[dict]) -> list[int]:  # on the tokenizer thread only
        return encode(chat_prompt(encoder, conversation))

    def submit(prompt_ids: list[int], params, param: str, shape: ResponseShape, body) -> Pending:
        try:
            engine_request = llm.make_request(next(request_numbers), prompt_ids, params)
        except CompiledSpecError as error:
            named = {"prompt": param, "logprobs": body.LOGPROBS_FIELD}.get(error.param)
            raise wire_error(error, param=named) from None
        pending = Pending(engine_request, asyncio.Queue(), asyncio.get_running_loop(), request_id=shape.id)
        retry = {"Retry-After": str(options.retry_after_s)}
        try:
            loop.submit(pending)
        except QueueFull:
            raise APIError(429, f"the server's queue is full ({options.max_queue} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full", headers=retry) from None
        except ShuttingDown:
            if not loop.alive:
                raise APIError(503, "the engine loop has stopped (the server log says why)", type="server_error",
                               code="engine_stopped") from None
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers=retry) from None
        return pending

    async def respond(request: Request, pending: Pending, body, shape: ResponseShape):
        if body.stream:
            return StreamingResponse(stream(pending, body, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        hung_up, event, outputs = asyncio.ensure_future(wait_for_disconnect(request)), None, {}
        try:
            while True:
                event = asyncio.ensure_future(pending.events.get())
                await asyncio.wait((event, hung_up), return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    return Response(status_code=499)  # nobody reads it; the finally clause aborts the request
                kind, value = event.result()
                if kind == "error":
                    return JSONResponse(internal_error_body(pending.request_id), status_code=500)
                if kind == "done":
                    choice, output = value
                    outputs[choice] = output
                    if len(outputs) == len(pending.choices):
                        return JSONResponse(shape.whole([outputs[i] for i in range(len(outputs))]))
        finally:
            hung_up.cancel()
            if event is not None:
                event.cancel()
            if not pending.ended:
                loop.abort(pending.index)

    async def stream(pending: Pending, body, shape: ResponseShape):
        def event(data: dict) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        texts = [TextStream(tokenizer, pending.request.params.stop) for _ in pending.choices]
        outputs: dict[int, RequestOutput] = {}
        try:
            if shape.chat:
                for choice in range(len(texts)):
                    yield event(shape.chunk("", first=True, choice=choice))
            while True:
                kind, value = await pending.events.get()
                if kind == "tokens":
                    choice, token_ids, logprobs = value
                    new_text = texts[choice].add(token_ids)
                    if new_text or logprobs:
                        yield event(shape.chunk(new_text, logprobs=logprobs, choice=choice))
                    continue
                if kind == "error":
                    yield event(internal_error_body(pending.request_id))
                else:
                    choice, output = value
                    outputs[choice] = output
                    yield event(shape.chunk(texts[choice].finish(output.text), finish_reason=output.finish_reason,
                                            choice=choice))
                    if len(outputs) < len(texts):
                        continue
                    if body.include_usage:
                        yield event(shape.usage_chunk([outputs[i] for i in range(len(outputs))]))
                yield "data: [DONE]\n\n"
                return
        finally:  # the client went away (the generator is closed or cancelled) or the response ended
            if not pending.ended:
                loop.abort(pending.index)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = parse(CompletionRequest, await read_json(request))
        check_model(body.model)
        params = body.sampling_params(COMPLETIONS_DEFAULT_MAX_TOKENS)
        text = body.prompt_text
        if text is not None:
            if not text:
                raise APIError(400, "empty prompt; a prompt needs at least one token", param="prompt")
            check_characters(len(text), "prompt")
            prompt_ids = await off_the_loop(encode, text)
        else:
            prompt_ids = body.prompt
        shape = ResponseShape(chat=False, model=options.model_name, pieces=pieces)
        return await respond(request, submit(prompt_ids, params, "prompt", shape, body), body, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = parse(ChatCompletionRequest, await read_json(request))
        check_model(body.model)
        conversation = body.conversation()
        check_characters(sum(len(turn["content"]) + len(turn.get("name", "")) for turn in conversation), "messages")
        params = body.sampling_params(llm.config.max_seq_len)  # OpenAI: up to the context's end by default
        try:
            prompt_ids = await off_the_loop(encode_chat, conversation)
        except CompiledSpecError as error:
            raise APIError(400, str(error), param=error.param) from None
        shape = ResponseShape(chat=True, model=options.model_name, pieces=pieces)
        pending = submit(prompt_ids, params, "messages", shape, body)
        return await respond(request, pending, body, shape)

    def model_card() -> dict:
        return {"id": options.model_name, "object": "model", "created": int(time.time()), "owned_by": "compiled-spec",
                "max_model_len": llm.config.max_seq_len, "num_speculative_tokens": llm.num_speculative_tokens,
                "graph_mode": llm.config.graph_mode.value}

    # Every GET route answers HEAD too (uvicorn sends the headers without the body).
    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(request: Request, model_id: str):
        authorize(request)
        check_model(model_id)
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not loop.alive:
            raise APIError(503, "the engine loop has stopped", type="server_error")
        # What steps run in now: "full", or during a tiered start "eager (full compiling in the background)" and
        # then "eager, then full from step N" (a string the engine thread swaps whole: safe to read here).
        return {"status": "ok", "graph_mode": loop.engine.startup.graph_mode_run()}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class LocalHostOnly:
    """ASGI middleware for a server without a key: a request's Host must name this machine by a loopback name
    (localhost, 127.0.0.1, [::1]) or by the address the connection came in on, with the listening port if it has
    one; anything else gets 421. A web page on another origin that rebinds its DNS name to this machine sends its
    own name as Host, so it cannot read the replies."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            hosts = [value for name, value in scope["headers"] if name == b"host"]
            if len(hosts) > 1 or hosts and not self.allowed(hosts[0].decode("latin-1"), scope.get("server")):
                shown_host = shown(hosts[0].decode("latin-1")) if len(hosts) == 1 else f"{len(hosts)} Host headers"
                error = APIError(421, f"the Host header ({shown_host}) does not name this server; a server without "
                                      "--api-key answers only localhost, 127.0.0.1, [::1] or the address it was "
                                      "reached on, with its port", code="invalid_host")
                await JSONResponse(error.body(), status_code=421)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def allowed(host: str, server: tuple[str, int] | None) -> bool:
        host = host.strip().lower()
        if host.startswith("["):
            name, bracket, port = host[1:].partition("]")
            if not bracket or port and not port.startswith(":"):
                return False
            port = port[1:]
        else:
            name, _, port = host.partition(":")
        if port and (not port.isdigit() or server is not None and int(port) != server[1]):
            return False
        if name == "localhost":
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False  # a name other than localhost: what a DNS-rebinding page sends
        if address.is_loopback:
            return True
        try:
            return server is not None and address == ipaddress.ip_address(server[0])
        except ValueError:
            return False


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: what comes next is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def internal_error_body(request_id: str) -> dict:
    """What a client learns of a fault of the server: the id to find it by in the server's log, not its text."""
    return APIError(500, f"internal error; request id {request_id} (the details are in the server log)",
                    type="server_error", code="internal_error").body()
