"""The OpenAI wire format: request bodies, the checks that turn them into SamplingParams, responses and errors.

Range rules live in SamplingParams; this module only checks shapes and what the engine does not support
(every unsupported field is a 400 that names it, never a silent ignore).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..detokenizer import TokenPieces
from ..errors import SHOWN_VALUE_CHARACTERS, CompiledSpecError, shown
from ..params import RequestOutput, SamplingParams, SpecStats, TokenLogprob

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
PROMPT_CHARACTERS_PER_TOKEN = 32  # a prompt longer than this many characters per token of the context is refused
# before it is tokenized: no tokenizer packs 32 characters into each token of a whole prompt
MESSAGE_CHARACTERS = 1000  # an error message is cut to this many (its head and tail kept)


def clip_message(message: str) -> str:
    """A message that echoes a long value from a lower layer, cut in the middle to MESSAGE_CHARACTERS characters."""
    if len(message) <= MESSAGE_CHARACTERS:
        return message
    half = MESSAGE_CHARACTERS // 2
    return f"{message[:half]}…[{len(message) - 2 * half} characters left out]…{message[-half:]}"


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        message = clip_message(message)
        if param is not None and len(param) > SHOWN_VALUE_CHARACTERS:
            param = param[:SHOWN_VALUE_CHARACTERS] + "…"
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# strict: a value of the wrong JSON type ("5" for an integer, true for an integer, "yes" for a boolean) is a 400,
# never coerced; a float field still takes an integer (clients send 1 for 1.0).
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


WIRE_NAMES = {"num_speculative_tokens": "speculation.num_speculative_tokens",
              "json_schema": "response_format"}  # SamplingParams field -> request field


def wire_error(error: CompiledSpecError, param: str | None = None) -> APIError:
    """A 400 for a CompiledSpecError about a SamplingParams field, naming the request field it came from (param:
    the request field to name instead)."""
    message, name = str(error), error.param
    if name in WIRE_NAMES:
        name = WIRE_NAMES[name]
        message = name + message[len(error.param):] if message.startswith(error.param) else message
    elif param and name and message.startswith(f"{name}="):  # chat's top_logprobs sets SamplingParams.logprobs
        message = param + message[len(name):]
    return APIError(400, message, param=param or name)


class Speculation(BaseModel):
    """This engine's extension: {"num_speculative_tokens": 0..K or "auto"}, the most drafts a step verifies for the
    request ("auto" or left out: the server's own, -k)."""

    model_config = STRICT
    num_speculative_tokens: int | Literal["auto"] | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always satisfies the schema, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def sampling_schema(self) -> dict | bool | None:
        """SamplingParams.json_schema."""
        if self.type != "json_schema" and self.json_schema is not None:
            raise APIError(400, f"response_format.json_schema is only allowed with type 'json_schema' (got type "
                                f"{shown(self.type)})", param="response_format.json_schema")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError(400, "response_format.json_schema is required with type 'json_schema': an object with "
                                    "a name and a schema", param="response_format.json_schema")
            return self.json_schema.schema_
        return True if self.type == "json_object" else None


class _Common(BaseModel):
    """Fields both endpoints share. vLLM's extensions top_k and ignore_eos are accepted too, and this engine's
    speculation."""

    model_config = STRICT
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the operator's logs; changes nothing
    ignore_eos: bool = False
    speculation: Speculation | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> dict[str, Any]:
        """Fields set to something the engine cannot do: {name: value}."""
        asked = {
            "presence_penalty": self.presence_penalty not in (None, 0),
            "frequency_penalty": self.frequency_penalty not in (None, 0),
            "logit_bias": bool(self.logit_bias),
        }
        return {name: getattr(self, name) for name, bad in asked.items() if bad}

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        for name, value in self.unsupported().items():
            raise APIError(400, f"{name}={shown(value)} is not supported by this server", param=name,
                           code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        top_k = self.top_k if self.top_k is not None else 0
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if top_k == -1 else top_k,  # -1 is "off" in vLLM
                max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
                stop=self.stop, seed=self.seed, ignore_eos=self.ignore_eos,
                num_speculative_tokens=self.speculation.num_speculative_tokens if self.speculation else None,
                logprobs=self.requested_logprobs(), n=1 if self.n is None else self.n,
                json_schema=self.response_format.sampling_schema() if self.response_format else None,
            )
        except CompiledSpecError as error:
            raise wire_error(error, param=self.LOGPROBS_FIELD if error.param == "logprobs" else None) from None

    LOGPROBS_FIELD: ClassVar[str] = "logprobs"  # the request field that sets SamplingParams.logprobs

    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many of the most likely tokens to return beside each one, None: none."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> dict[str, Any]:
        asked = super().unsupported()
        for name, bad in (("echo", self.echo), ("best_of", self.best_of not in (None, 1)),
                          ("suffix", self.suffix is not None)):
            if bad:
                asked[name] = getattr(self, name)
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and all(isinstance(p, str) for p in self.prompt):
            asked["prompt"] = f"a list of {len(self.prompt)} strings (send one prompt per request)"
        return asked

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_text(self) -> str | None:
        """The prompt's text (a string, or a list of one string), or None for token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) == 1 and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[dict[str, Any]]  # text, or OpenAI's content parts ({"type": "text", "text": ...} only)
    name: str | None = None

    def text(self, number: int) -> str:
        """The content as one string: text parts joined with newlines (as vLLM joins them)."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for index, part in enumerate(self.content):
            where = f"messages.{number}.content.{index}"
            if part.get("type") != "text":
                raise APIError(400, f"{where}.type: only text parts are supported (got type "
                                    f"{shown(part.get('type'))})", param=f"{where}.type", code="unsupported_parameter")
            for key in part:
                if key not in ("type", "text"):
                    raise APIError(400, f"unknown parameter {shown(f'{where}.{key}')} in a text part",
                                   param=f"{where}.{key}", code="unsupported_parameter")
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.text: a text part needs a string 'text' (got {shown(part.get('text'))})",
                               param=f"{where}.text")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None

    def unsupported(self) -> dict[str, Any]:
        asked = super().unsupported()
        no_ops = {"tools": (None, []), "tool_choice": (None, "none")}
        for name, accepted in no_ops.items():
            value = getattr(self, name)
            if not any(value == ok and type(value) is type(ok) for ok in accepted):
                asked[name] = value
        return asked

    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "set max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

    def conversation(self) -> list[dict]:
        """The messages for the chat template, each one's content as one string."""
        conversation = []
        for number, message in enumerate(self.messages):
            turn = message.model_dump(exclude_none=True)
            turn["content"] = message.text(number)
            conversation.append(turn)
        return conversation


def parse(model_class: type[BaseModel], body: Any) -> BaseModel:
    """The validated body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_class.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        location = [str(part) for part in first["loc"] if not str(part).startswith(("function-", "json-or-python"))]
        # A union reports each member it tried; the field is what comes before the member's name.
        param = ".".join(part for part in location if part not in ("str", "int", "float", "bool") and "[" not in part)
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"unknown parameter {shown(param)}", param=param,
                           code="unsupported_parameter") from None
        if first["type"] == "missing":
            raise APIError(400, f"{param} is required", param=param) from None
        raise APIError(400, f"{param}: {first['msg']} (got {shown(first.get('input'))})", param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    """A response's usage: its prompt once (n choices share its prefill), the tokens of every choice."""
    prompt, completion = len(outputs[0].prompt_token_ids), sum(len(output.token_ids) for output in outputs)
    stats = SpecStats(outputs[0].stats.num_speculative_tokens)
    for output in outputs:
        stats.merge(output.stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "spec_decode": spec_decode_stats(stats)}


def spec_decode_stats(stats: SpecStats) -> dict:
    """What speculation did for one response (names as vLLM's spec_decode metrics)."""
    return {
        "num_speculative_tokens": stats.num_speculative_tokens,
        "num_drafts": stats.steps,
        "num_draft_tokens": stats.drafted,
        "num_accepted_tokens": stats.accepted,
        "num_accepted_tokens_per_pos": list(stats.accepted_per_position),
        "acceptance_rate_per_position": stats.acceptance_rate_per_position,
        "mean_accepted_length": stats.mean_accepted_length,
        "num_steps_per_num_drafts": {str(k): count for k, count in sorted(stats.steps_per_num_drafts.items())},
        "num_tree_steps": stats.tree_steps,
        "num_leaf_steps": stats.leaf_steps,
    }


LOWEST_LOGPROB = -9999.0  # JSON has no -Infinity: a log-probability below this is sent as this (as vLLM does)


class ResponseShape:
    """The JSON of one response, whole or in streamed chunks, for completions or chat.

    pieces: each token's text and bytes, for logprobs (detokenizer.TokenPieces)."""

    def __init__(self, chat: bool, model: str, pieces: TokenPieces | None = None):
        self.chat, self.model, self.pieces = chat, model, pieces
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # completions: where each choice's next token's text starts

    def logprobs(self, entries: list[TokenLogprob] | None, choice: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat's {"content": [...]}, or the completions' four lists."""
        if entries is None:
            return None
        if self.chat:
            def item(token_id: int, logprob: float) -> dict:
                return {"token": self.pieces.text(token_id), "logprob": max(logprob, LOWEST_LOGPROB),
                        "bytes": list(self.pieces.bytes(token_id))}
            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(*top) for top in e.top_logprobs]}
                                for e in entries]}
        tokens, offsets = [self.pieces.text(e.token_id) for e in entries], []
        for token in tokens:
            offsets.append(self.text_offsets.get(choice, 0))
            self.text_offsets[choice] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": [max(e.logprob, LOWEST_LOGPROB) for e in entries],
                "top_logprobs": [{self.pieces.text(i): max(lp, LOWEST_LOGPROB) for i, lp in e.top_logprobs}
                                 for e in entries],
                "text_offset": offsets}

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, outputs: list[RequestOutput]) -> dict:
        """The response of every choice, in order."""
        choices = []
        for index, output in enumerate(outputs):
            logprobs = self.logprobs(output.logprobs, index)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": output.text},
                                "logprobs": logprobs, "finish_reason": output.finish_reason})
            else:
                choices.append({"index": index, "text": output.text, "logprobs": logprobs,
                                "finish_reason": output.finish_reason})
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(outputs)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False,
              logprobs: list[TokenLogprob] | None = None, choice: int = 0) -> dict:
        """A streamed chunk of one choice: text, and the logprobs of the tokens that arrived with it (their text may
        come in a later chunk, held back while it could still become a stop string)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return self._envelope("chat.completion.chunk", [{"index": choice, "delta": delta,
                                                              "logprobs": self.logprobs(logprobs, choice),
                                                              "finish_reason": finish_reason}])
        return self._envelope("text_completion", [{"index": choice, "text": text,
                                                   "logprobs": self.logprobs(logprobs, choice),
                                                   "finish_reason": finish_reason}])

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(outputs)
        return body
