"""HTTP routes of the agent gateway on the rollout service's app.

- ``POST /v1/episodes``, ``GET /v1/episodes/{id}``, ``POST /v1/episodes/{id}/finish``: the run token
  (``auth.token``) like every control endpoint; bodies strict (unknown fields, wrong types: 422
  naming the field).
- ``/openai/v1/chat/completions``, ``/openai/v1/completions``, ``/openai/v1/models``: the episode key
  as the bearer token instead of the run token (``protect`` below lets ``/openai/`` through the run
  token's check; these routes check the key themselves); errors in OpenAI's shape.
Every body is bounded by ``rollout.max_body_mb`` (``shared.serving.BodyLimit`` around the app).

``mount`` also publishes the two OpenAI POST routes as plain ``(authorization, body) -> Response``
handlers (``inproc.direct_routes``), for in-process callers that bring a whole body: the same code
the routes run, without the ASGI middleware and routing layers, which do nothing else for these paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from headrace.rollout.gateway.inproc import DIRECT_STATE
from headrace.rollout.gateway.openai_api import (ApiError, ChatRequest, CompletionRequest, chat_chunks,
                                                 completion_chunks, parse)
from headrace.shared.auth import BearerAuth, Guard
from headrace.shared.schemas import MAX_GROUP_SIZE, Freeform, FreeformMap, WireFloat, WireInt

if TYPE_CHECKING:
    from headrace.rollout.gateway.gateway import Gateway

OPENAI_PREFIX = "/openai/"
CHAT_PATH = "/openai/v1/chat/completions"
COMPLETIONS_PATH = "/openai/v1/completions"


class OpenEpisode(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    group_id: StrictStr | None = Field(default=None, min_length=1, max_length=480,
                                       description="episodes sharing it form one group (kept verbatim)")
    group_size: WireInt = Field(default=1, ge=1, le=MAX_GROUP_SIZE, description="episodes in the group")
    label: Freeform = None
    metadata: FreeformMap = Field(default_factory=dict)


class FinishEpisode(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    reward: WireFloat | None = Field(default=None, allow_inf_nan=False,
                                     description="the episode's reward (null: the reward function scores it)")


class _GatewayAuth(BearerAuth):
    """The run token everywhere but under /openai/, where the routes check an episode key."""

    passes_openai_through = True   # what ``inproc.direct_routes`` relies on

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(OPENAI_PREFIX):
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def protect(app: FastAPI, auth: Any) -> None:
    """``shared.auth.protect`` with the gateway's exception for /openai/ (episode keys)."""
    guard = Guard.of(auth)
    if guard.active:
        app.add_middleware(_GatewayAuth, guard=guard)


def mount(app: FastAPI, gateway: "Any") -> None:
    """Add the routes; ``gateway()`` returns the service's Gateway (built at start-up)."""

    def gw() -> "Gateway":
        return gateway()

    def http_error(e: ApiError) -> HTTPException:
        return HTTPException(e.status, e.message)

    @app.post("/v1/episodes")
    async def open_episode(request: Request, req: OpenEpisode | None = None) -> dict[str, Any]:
        req = req or OpenEpisode()
        try:
            ep, key = gw().store.open(req.group_id, req.group_size, req.label, req.metadata)
        except ApiError as e:
            raise http_error(e) from None
        base = str(request.base_url).rstrip("/")
        return {"episode_id": ep.id, "group_id": ep.group_id, "base_url": f"{base}/openai/v1", "api_key": key}

    @app.get("/v1/episodes/{episode_id}")
    async def get_episode(episode_id: str) -> dict[str, Any]:
        try:
            return gw().store.get(episode_id).view()
        except ApiError as e:
            raise http_error(e) from None

    @app.post("/v1/episodes/{episode_id}/finish")
    async def finish_episode(episode_id: str, req: FinishEpisode | None = None) -> dict[str, Any]:
        store = gw().store
        try:
            ep = await store.finish(store.get(episode_id), reward=(req or FinishEpisode()).reward)
        except ApiError as e:
            raise http_error(e) from None
        return {"episode_id": ep.id, "state": ep.state, "samples": len(ep.samples), "error": ep.error}

    async def _openai(authorization: str | None, body: bytes, model: Any, call: Any, chunks: Any) -> Response:
        """One OpenAI call: the episode from its key, the body, the call; JSON or server-sent events."""
        try:
            g = gw()
            ep = g.store.authenticate(authorization)
            req = parse(model, body)
            answer = await call(g.calls)(ep, req)
        except ApiError as e:
            gw().store.counts["refused_calls"] += e.status < 500
            return e.response()
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(chunks(answer, usage), media_type="text/event-stream")
        return Response(orjson.dumps(answer), media_type="application/json")

    async def chat_call(authorization: str | None, body: bytes) -> Response:
        return await _openai(authorization, body, ChatRequest, lambda calls: calls.chat, chat_chunks)

    async def completion_call(authorization: str | None, body: bytes) -> Response:
        return await _openai(authorization, body, CompletionRequest, lambda calls: calls.completion, completion_chunks)

    async def chat(request: Request) -> Response:
        return await chat_call(request.headers.get("authorization"), await request.body())

    async def completions(request: Request) -> Response:
        return await completion_call(request.headers.get("authorization"), await request.body())

    # plain Starlette routes: they read and validate their body themselves (``parse``), so FastAPI's
    # per-request dependency solving and response encoding would be pure overhead on the hot path
    app.add_route(CHAT_PATH, chat, methods=["POST"])
    app.add_route(COMPLETIONS_PATH, completions, methods=["POST"])
    setattr(app.state, DIRECT_STATE, {CHAT_PATH: chat_call, COMPLETIONS_PATH: completion_call})

    def _model(g: "Gateway") -> dict[str, Any]:
        return {"id": g.model_name, "object": "model", "created": 0, "owned_by": "headrace"}

    @app.get("/openai/v1/models")
    async def models(request: Request) -> Response:
        try:
            g = gw()
            g.store.authenticate(request.headers.get("authorization"))
        except ApiError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [_model(g)]})

    @app.get("/openai/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        try:
            g = gw()
            g.store.authenticate(request.headers.get("authorization"))
            g.calls.check_model(model)
        except ApiError as e:
            return e.response()
        return JSONResponse(_model(g))
