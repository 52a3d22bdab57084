"""The OpenAI wire shapes the gateway speaks: strict request models, answers, errors and SSE chunks.

Guarantees:
- Requests are validated strictly: unknown fields are refused (as OpenAI does: "Unrecognized
  request argument"), so are values the gateway cannot honour (``n`` > 1, ``top_logprobs`` > 0,
  roles other than system / developer / user / assistant / tool, tool-call arguments that are not
  JSON). Fields an SDK may send that change nothing here (``user``, ``store``, ``metadata``,
  ``parallel_tool_calls``, zero penalties, ...) are accepted and ignored.
- ``error(status, message, param)`` is OpenAI's error shape ``{"error": {"message", "type",
  "param", "code"}}``; the ``openai`` client turns it into ``BadRequestError`` (400),
  ``AuthenticationError`` (401), ``NotFoundError`` (404), ...
- Answers (``chat_completion``, ``text_completion``, ``chat_chunks``) are what the official
  ``openai`` Python client parses, ``usage`` included.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator, Literal

import orjson
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from headrace.rollout.gateway.toolcalls import ToolCall

MAX_MESSAGES = 4096
MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class FunctionCall(_Strict):
    name: StrictStr = Field(min_length=1, max_length=256)
    arguments: StrictStr = Field(max_length=1_000_000)


class ToolCallIn(_Strict):
    id: StrictStr | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=256)
    tool_call_id: StrictStr | None = Field(default=None, max_length=256)
    # what the SDK's own message objects carry when an agent appends them as they came
    refusal: StrictStr | None = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None
    reasoning_content: Any = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    model: StrictStr = Field(min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(default=1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=0.0, le=0.0)
    presence_penalty: float | None = Field(default=None, ge=0.0, le=0.0)
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=1024)
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=0)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=0)
    echo: StrictBool = Field(default=False)
    suffix: None = None


class ApiError(Exception):
    """A request the gateway refuses: becomes OpenAI's error shape with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {401: "authentication_error", 404: "not_found_error",
                             503: "service_unavailable", 429: "rate_limit_error"}.get(status, "invalid_request_error")

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": None}}, status_code=self.status,
                            headers={"WWW-Authenticate": "Bearer"} if self.status == 401 else None)


def parse(model: type[_Sampling], body: bytes) -> Any:
    """``model`` from a raw body, or ApiError(400) naming the first bad field."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        er = e.errors()[0]
        loc = ".".join(str(x) for x in er["loc"])
        msg = "Unrecognized request argument supplied: " + loc if er["type"] == "extra_forbidden" else \
            f"{loc}: {er['msg']}"
        if loc == "n":
            msg = "n: only n=1 is supported (one episode is one trajectory; open more episodes)"
        raise ApiError(400, msg, loc) from None


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, p in enumerate(content):
        if p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise ApiError(400, f"{where}.content[{i}]: only text parts are supported", f"{where}.content")
        parts.append(p["text"])
    return "".join(parts)


def template_messages(msgs: list[Message]) -> list[dict[str, Any]]:
    """The messages as chat-template dicts (tool-call arguments parsed); ApiError for bad roles or JSON."""
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if m.role not in ROLES:
            raise ApiError(400, f"{where}.role: {m.role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": content_text(m.content, where)}
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, f"{where}: only assistant messages have tool_calls", f"{where}.tool_calls")
            calls = []
            for j, tc in enumerate(m.tool_calls):
                try:
                    args = json.loads(tc.function.arguments) if tc.function.arguments.strip() else {}
                except ValueError:
                    raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                                   f"{where}.tool_calls") from None
                calls.append({"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def normalized(msgs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What prefix matching compares: role, content, tool calls (name, arguments), tool_call_id."""
    return [(m["role"], m.get("content") or "", tuple((c["function"]["name"], json.dumps(c["function"]["arguments"],
                                                                                       sort_keys=True))
                                                      for c in m.get("tool_calls") or ()), m.get("tool_call_id"))
            for m in msgs]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)], "refusal": None}


def chat_completion(model: str, content: str | None, calls: list[ToolCall], finish: str,
                    n_prompt: int, n_completion: int, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": logprobs}],
            "usage": usage(n_prompt, n_completion)}


def chat_chunks(answer: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    """A finished chat completion as the SSE events of a stream (role, content, tool calls, finish,
    usage when asked, ``[DONE]``)."""
    base = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}
    choice = answer["choices"][0]
    msg = choice["message"]

    def event(delta: dict[str, Any], finish: str | None = None, lp: Any = None, **extra: Any) -> bytes:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}], **extra}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    yield event({"role": "assistant", "content": ""})
    if msg["content"]:
        yield event({"content": msg["content"]}, lp=choice["logprobs"])
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        yield event({"tool_calls": [{"index": i, **tc}]})
    yield event({}, choice["finish_reason"])
    if include_usage:
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": answer["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def text_completion(model: str, text: str, finish: str, n_prompt: int, n_completion: int,
                    tokens: list[str] | None, logprobs: list[float]) -> dict[str, Any]:
    lp = None
    if tokens is not None:
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        lp = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": [{} for _ in tokens], "text_offset": offsets}
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}],
            "usage": usage(n_prompt, n_completion)}


def completion_chunks(answer: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    choice = answer["choices"][0]
    base = {k: answer[k] for k in ("id", "object", "created", "model")}
    yield b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
    if include_usage:
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": answer["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"
