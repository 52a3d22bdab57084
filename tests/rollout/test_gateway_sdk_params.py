"""The shortcut past the ``openai`` SDK's params transform (``rollout/gateway/sdk_params.py``): its
answer equals the SDK's on the params agents send, everything else goes to the SDK, and a real
``AsyncOpenAI`` sends the same request bytes with it as without it (no network: an httpx transport
that records the request)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from openai._types import NOT_GIVEN, omit  # noqa: E402
from openai._utils._transform import PropertyInfo  # noqa: E402
from openai._utils._transform import async_maybe_transform as sdk_transform  # noqa: E402
from openai.types import completion_create_params as text_params  # noqa: E402
from openai.types.chat import ChatCompletionMessage  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402
from typing_extensions import Annotated, Required, TypedDict  # noqa: E402

from headrace.rollout.gateway import sdk_params  # noqa: E402
from headrace.rollout.gateway.inproc import http_library  # noqa: E402

CHAT = chat_params.CompletionCreateParamsNonStreaming
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate", "parameters": {
        "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": [{"type": "text", "text": "2+3?"},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"expr\": \"2+3\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "5", "name": "bot"},
    {"role": "user", "content": "and 4.5 more?"},
]
CASES: list[tuple[Any, dict[str, Any]]] = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "model": "m", "temperature": omit,
            "top_p": NOT_GIVEN, "stream": False}),
    (CHAT, {"messages": MESSAGES, "model": "m", "tools": TOOLS, "tool_choice": "auto", "temperature": 0.7,
            "max_completion_tokens": 16, "stop": ["\n\n", "END"], "seed": 3, "logprobs": True,
            "top_logprobs": 2, "logit_bias": {"42": -100}, "metadata": {"run": "x"}, "n": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
            "user": omit, "stream_options": omit}),
    (chat_params.CompletionCreateParamsStreaming,
     {"messages": MESSAGES[:2], "model": "m", "stream": True, "stream_options": {"include_usage": True}}),
    (text_params.CompletionCreateParamsNonStreaming,
     {"prompt": "1 + 1 =", "model": "m", "max_tokens": 4, "stop": "\n", "echo": omit, "suffix": None}),
    (text_params.CompletionCreateParamsNonStreaming, {"prompt": [[1, 2, 3]], "model": "m", "temperature": 0}),
]


@pytest.mark.parametrize("params_type,data", CASES)
def test_answer_equals_the_sdk_transform(params_type: Any, data: dict[str, Any]) -> None:
    ours = sdk_params.plain_params(data, params_type)
    assert ours is not None, "plain params of a type without aliases take the shortcut"
    assert ours == asyncio.run(sdk_transform(data, params_type))
    assert json.dumps(ours) == json.dumps(asyncio.run(sdk_transform(data, params_type)))


def _gen():
    yield {"role": "user", "content": "hi"}


@pytest.mark.parametrize("messages,why", [
    (({"role": "user", "content": "hi"},), "a tuple (the SDK makes it a list)"),
    (_gen(), "a generator (the SDK makes it a list)"),
    ([ChatCompletionMessage(role="assistant", content="x")], "a pydantic model (the SDK dumps it)"),
    ([{"role": "user", "content": "hi", "name": NOT_GIVEN}], "a left-out value below the top level"),
    ([{"role": "user", 1: "hi"}], "a key that is not a str"),
    ([{"role": "user", "content": b"hi"}], "bytes"),
])
def test_anything_not_plain_goes_to_the_sdk(messages: Any, why: str) -> None:
    assert sdk_params.plain_params({"messages": messages, "model": "m"}, CHAT) is None, why


def test_a_type_that_declares_an_alias_or_a_format_goes_to_the_sdk() -> None:
    class Inner(TypedDict, total=False):
        when: Annotated[str, PropertyInfo(format="iso8601")]

    class Params(TypedDict, total=False):
        card_id: Required[Annotated[str, PropertyInfo(alias="cardID")]]

    class Nested(TypedDict, total=False):
        items: list[Inner]

    assert sdk_params.plain_params({"card_id": "c"}, Params) is None
    assert asyncio.run(sdk_transform({"card_id": "c"}, Params)) == {"cardID": "c"}
    assert sdk_params.plain_params({"items": [{"when": "x"}]}, Nested) is None
    assert sdk_params.plain_params({"x": 1}, "NotAType") is None
    assert sdk_params.plain_params([("not", "a dict")], CHAT) is None


class _Recorder:
    """An httpx(2) transport that answers every chat call with one fixed completion and keeps the
    request bodies."""

    def __init__(self, http: Any) -> None:
        self.http = http
        self.bodies: list[bytes] = []

    async def handle_async_request(self, request: Any) -> Any:
        self.bodies.append(await request.aread())
        answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "5"}, "finish_reason": "stop"}]}
        return self.http.Response(200, json=answer)

    async def aclose(self) -> None:
        pass


def test_a_real_client_sends_the_same_bytes_and_the_sdk_walk_runs_only_when_needed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import openai.resources.chat.completions.completions as chat_module

    walks: list[Any] = []

    async def counted(data: Any, expected_type: Any) -> Any:
        walks.append(expected_type)
        return await sdk_transform(data, expected_type)

    monkeypatch.setattr(chat_module, "async_maybe_transform", counted)   # restored after the test
    http = http_library()
    recorder = _Recorder(http)
    client = openai.AsyncOpenAI(base_url="http://gateway.test/v1", api_key="k", max_retries=0,
                                http_client=http.AsyncClient(transport=recorder))
    as_model = [MESSAGES[0], ChatCompletionMessage(role="assistant", content="ok")]

    async def calls() -> None:
        await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, temperature=0.5)
        await client.chat.completions.create(model="m", messages=as_model)

    asyncio.run(calls())
    assert len(walks) == 2
    assert sdk_params.install() and sdk_params.install(), "in place in both resources, idempotently"
    assert getattr(chat_module.async_maybe_transform, "__headrace_plain_params__") is counted
    asyncio.run(calls())
    assert len(walks) == 3, "the plain call skipped the SDK's walk; the one with a model did not"
    assert recorder.bodies[2] == recorder.bodies[0] and recorder.bodies[3] == recorder.bodies[1]
    assert json.loads(recorder.bodies[3])["messages"][1] == {"role": "assistant", "content": "ok"}
