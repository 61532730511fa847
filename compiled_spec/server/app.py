"""The HTTP side of `compiled-spec serve`: OpenAI-compatible routes over one EngineLoop.

Handlers run on uvicorn's event loop and never touch the engine: they check a request, tokenize it with
their own copy of the tokenizer (the engine thread decodes with the other), submit it, and relay its events.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import itertools
import json
import logging
import sys
import time
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
from ..detokenizer import TextStream
from .engine_loop import EngineLoop, Pending, QueueFull, ShuttingDown
from .metrics import ServerMetrics
from .protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, APIError, ChatCompletionRequest, CompletionRequest,
                       ResponseShape, new_id, parse)

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


def create_app(llm: LLM, options: ServerOptions) -> FastAPI:
    if llm.tokenizer is None:
        raise CompiledSpecError(f"serve needs a model with a tokenizer; {str(llm.path)!r} has none")
    if options.api_key is not None and not options.api_key.strip():
        raise CompiledSpecError("the API key is empty; give a non-empty key, or none to serve without one")
    metrics = ServerMetrics(options.model_name, llm.draft_slots)
    loop = EngineLoop(llm.engine, metrics, options.max_queue, options.step_log)
    tokenizer = copy.deepcopy(llm.tokenizer)
    request_numbers = itertools.count()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        await asyncio.to_thread(loop.wait_ready)
        yield
        loop.stop()  # uvicorn has let in-flight responses finish (or cut them at its timeout); abort the rest

    app = FastAPI(title="compiled-spec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(APIError(error.status_code, str(error.detail), code=code).body(),
                            status_code=error.status_code)

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
        header = request.headers.get("authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
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
        try:  # JSON may escape half a UTF-16 pair ("\\ud800"): no text, and the tokenizer cannot take it
            json.dumps(parsed, ensure_ascii=False).encode()
        except UnicodeEncodeError as error:
            raise APIError(400, f"the request body has a string that is not valid Unicode ({error.reason}: "
                                f"{error.object[error.start:error.end]!a})", code="invalid_json") from None
        return parsed

    def check_model(name: str) -> None:
        if name != options.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {options.model_name!r}",
                           param="model", code="model_not_found")

    def submit(prompt_ids: list[int], params, param: str, shape: ResponseShape) -> Pending:
        try:
            engine_request = llm.make_request(next(request_numbers), prompt_ids, params)
        except CompiledSpecError as error:
            raise APIError(400, str(error), param=param if error.param == "prompt" else error.param) from None
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
        hung_up, event = asyncio.ensure_future(wait_for_disconnect(request)), None
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
                    return JSONResponse(shape.whole(value))
        finally:
            hung_up.cancel()
            if event is not None:
                event.cancel()
            if not pending.ended:
                loop.abort(pending.index)

    async def stream(pending: Pending, body, shape: ResponseShape):
        def event(data: dict) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        text = TextStream(tokenizer, pending.request.params.stop)
        try:
            if shape.chat:
                yield event(shape.chunk("", first=True))
            while True:
                kind, value = await pending.events.get()
                if kind == "tokens":
                    new_text = text.add(value)
                    if new_text:
                        yield event(shape.chunk(new_text))
                    continue
                if kind == "error":
                    yield event(internal_error_body(pending.request_id))
                else:
                    output: RequestOutput = value
                    yield event(shape.chunk(text.finish(output.text), finish_reason=output.finish_reason))
                    if body.include_usage:
                        yield event(shape.usage_chunk(output))
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
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise APIError(400, "empty prompt; a prompt needs at least one token", param="prompt")
            prompt_ids = tokenizer.encode(body.prompt, add_special_tokens=False)
        else:
            prompt_ids = body.prompt
        shape = ResponseShape(chat=False, model=options.model_name)
        return await respond(request, submit(prompt_ids, params, "prompt", shape), body, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = parse(ChatCompletionRequest, await read_json(request))
        check_model(body.model)
        try:
            prompt = chat_prompt(tokenizer, body.conversation())
        except CompiledSpecError as error:
            raise APIError(400, str(error), param=error.param) from None
        params = body.sampling_params(llm.config.max_seq_len)  # OpenAI: up to the context's end by default
        shape = ResponseShape(chat=True, model=options.model_name)
        pending = submit(tokenizer.encode(prompt, add_special_tokens=False), params, "messages", shape)
        return await respond(request, pending, body, shape)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{
            "id": options.model_name, "object": "model", "created": int(time.time()), "owned_by": "compiled-spec",
            "max_model_len": llm.config.max_seq_len, "num_speculative_tokens": llm.num_speculative_tokens,
            "graph_mode": llm.config.graph_mode.value,
        }]}

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise APIError(503, "the engine loop has stopped", type="server_error")
        # What steps run in now: "full", or during a tiered start "eager (full compiling in the background)" and
        # then "eager, then full from step N" (a string the engine thread swaps whole: safe to read here).
        return {"status": "ok", "graph_mode": loop.engine.startup.graph_mode_run()}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: what comes next is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def internal_error_body(request_id: str) -> dict:
    """What a client learns of a fault of the server: the id to find it by in the server's log, not its text."""
    return APIError(500, f"internal error; request id {request_id} (the details are in the server log)",
                    type="server_error", code="internal_error").body()
