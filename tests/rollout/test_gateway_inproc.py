"""In-service agents' calls are served in-process (``rollout/gateway/inproc.py``), through the same app
as a socket request: the episode key is checked (401 in OpenAI's shape), bad requests are 400 and leave
the episode usable, the service's body limit applies (413), and an agent closing its client leaves the
shared HTTP client open for the other episodes. The chat and completion POSTs skip the ASGI layers
(the direct lane): their answers are byte for byte the app's. No engine is reached: every request here
is refused before the engine call (calls that reach the engine: test_gateway_agents.py, real services)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
from fastapi import FastAPI

from headrace.rollout.gateway import routes
from headrace.rollout.gateway.gateway import Gateway
from headrace.rollout.gateway.inproc import AppTransport, direct_routes, http_library
from headrace.rollout.rewards import exact_match
from headrace.shared.config import HeadraceConfig
from headrace.shared.modelzoo import load_tokenizer


async def _agent(ctx: Any, task: dict) -> float:
    return 0.0


def _gateway(tiny_model: Path) -> tuple[FastAPI, Gateway]:
    cfg = HeadraceConfig(model=str(tiny_model), rollout={"gateway": {"model_name": "m"}, "max_body_mb": 0.01})
    app = FastAPI()
    gw = Gateway(cfg, None, load_tokenizer(tiny_model), exact_match, None, "r", None, _agent, app=app)
    routes.protect(app, cfg.auth)
    routes.mount(app, lambda: gw)
    return app, gw


def test_inprocess_calls_go_through_the_app(tiny_model: Path) -> None:
    app, gw = _gateway(tiny_model)
    runner = gw.agent
    assert runner is not None

    async def run() -> None:
        ep, key = gw.store.open(managed=False)
        client, own = runner._client(key)
        assert own is None                                   # the shared in-process client
        other, _ = runner._client("hr-ep-not-a-key")
        msgs = [{"role": "user", "content": "hi"}]
        try:
            await other.chat.completions.create(model="m", messages=msgs)
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and "unknown or finished episode" in e.message
        try:
            await client.chat.completions.create(model="m", messages=msgs, n=2)
            raise AssertionError("n=2 was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "only n=1" in e.message
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 20_000}])
            raise AssertionError("a body over rollout.max_body_mb was accepted")
        except openai.APIStatusError as e:
            assert e.status_code == 413 and "rollout.max_body_mb" in str(e.body)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
        await other.close()                                   # an agent closing its client ...
        assert [m.id for m in (await client.models.list()).data] == ["m"]   # ... leaves the others' open
        # refused: the 401 and the 400 (the 413 is the body limit's, before the route)
        assert ep.state == "open" and ep.calls == 0 and gw.store.counts["refused_calls"] == 2
        await runner.close()

    asyncio.run(run())


def test_direct_lane_answers_as_the_app(tiny_model: Path) -> None:
    app, gw = _gateway(tiny_model)
    seen: list[str] = []

    async def counted(scope: Any, receive: Any, send: Any) -> None:   # what reaches the ASGI app
        seen.append(scope["path"])
        await gw.agent.app(scope, receive, send)        # the app behind the body limit, as in the service

    http = http_library()
    origin = "http://127.0.0.1:9"
    max_body = int(gw.agent.max_body)
    direct = AppTransport(counted, origin, http, lambda: direct_routes(app), max_body)
    whole = AppTransport(counted, origin, http)
    assert set(direct_routes(app)) == {"/openai/v1/chat/completions", "/openai/v1/completions"}

    async def run() -> None:
        ep, key = gw.store.open(managed=False)
        cases = [("chat/completions", key, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
                 ("chat/completions", key, {"model": "other", "messages": [{"role": "user", "content": "hi"}]}),
                 ("chat/completions", "hr-ep-wrong", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                 ("chat/completions", key, {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}),
                 ("completions", key, {"model": "m", "prompt": "", "max_tokens": 2}),
                 ("completions", key, b"{not json")]
        async with http.AsyncClient(transport=direct) as a, http.AsyncClient(transport=whole) as b:
            for path, k, body in cases:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                headers = {"Authorization": f"Bearer {k}"}
                url = f"{origin}/openai/v1/{path}"
                ra, rb = await a.post(url, headers=headers, **kw), await b.post(url, headers=headers, **kw)
                assert (ra.status_code, ra.headers.raw, ra.content) == (rb.status_code, rb.headers.raw, rb.content)
                assert ra.status_code in (400, 401, 404) and "error" in ra.json(), ra.text
            assert len(seen) == len(cases)          # only the whole-app transport went through the app
            big = {"model": "m", "messages": [{"role": "user", "content": "x" * (max_body + 1)}]}
            r = await a.post(f"{origin}/openai/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json=big)
            assert r.status_code == 413 and seen[-1] == "/openai/v1/chat/completions"   # the app's BodyLimit
        assert ep.state == "open" and ep.calls == 0

    asyncio.run(run())


def test_direct_lane_off_under_a_foreign_middleware(tiny_model: Path) -> None:
    from starlette.middleware.gzip import GZipMiddleware

    app, _ = _gateway(tiny_model)
    assert direct_routes(app)
    app.add_middleware(GZipMiddleware)          # might act on /openai/: every request goes through the app
    assert direct_routes(app) == {}
    assert direct_routes(FastAPI()) == {}       # routes not mounted


def test_clients_share_the_sdks_platform(tiny_model: Path) -> None:
    from openai._base_client import get_platform

    _, gw = _gateway(tiny_model)
    runner = gw.agent
    assert runner is not None
    a, _ = runner._client("hr-ep-a")
    b, _ = runner._client("hr-ep-b")
    # the value the SDK would compute in a worker thread on each client's first request, computed once
    assert a._platform == b._platform == get_platform()
    for c, key in ((a, "hr-ep-a"), (b, "hr-ep-b")):   # copies of one client, each bound to its key
        assert isinstance(c, openai.AsyncOpenAI) and c.api_key == key and c.max_retries == 0
        assert str(c.base_url) == runner.base_url + "/" and c._client is runner._shared
