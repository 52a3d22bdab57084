"""In-service agents' calls are served in-process (``rollout/gateway/inproc.py``), through the same app
as a socket request: the episode key is checked (401 in OpenAI's shape), bad requests are 400 and leave
the episode usable, the service's body limit applies (413), and an agent closing its client leaves the
shared HTTP client open for the other episodes. No engine is reached: every request here is refused
before the engine call (calls that reach the engine: test_gateway_agents.py, real services)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
from fastapi import FastAPI

from headrace.rollout.gateway import routes
from headrace.rollout.gateway.gateway import Gateway
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
