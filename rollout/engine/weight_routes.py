"""The five weight-update endpoints of SGLang 0.5.23 over one ``UpdateSession``: each body is
validated with the model the sender builds it from (``shared.weight_sync.protocol``), the session
decides, blocking work runs in a worker thread. Answers are ``{"success", "message"}``: 200, or 400
with the reason (a bad body, a refused transition, a failed update)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import Response

from headrace.rollout.engine.http import answer, json_body
from headrace.rollout.engine.session import SessionError, UpdateSession
from headrace.shared.weight_sync.protocol import DestroyGroupRequest, InitGroupRequest, UpdateBucketRequest, parse

__all__ = ["add_weight_routes"]


def add_weight_routes(app: Any, session: UpdateSession) -> None:
    """Mount ``/init_weights_update_group``, ``/begin_weight_update``,
    ``/update_weights_from_distributed``, ``/end_weight_update`` and
    ``/destroy_weights_update_group`` (POST) on a FastAPI ``app``."""
    routes: dict[str, tuple[type | None, Callable[..., str]]] = {
        "/init_weights_update_group": (InitGroupRequest, session.init_group),
        "/begin_weight_update": (None, session.begin),
        "/update_weights_from_distributed": (UpdateBucketRequest, session.bucket),
        "/end_weight_update": (None, session.end),
        "/destroy_weights_update_group": (DestroyGroupRequest, session.destroy_group),
    }
    for path, (model, method) in routes.items():
        app.add_api_route(path, _endpoint(path.lstrip("/"), model, method), methods=["POST"])


def _endpoint(name: str, model: type | None, method: Callable[..., str]) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        try:
            body = await json_body(request)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            args = () if model is None else (parse(model, body),)
        except ValueError as e:
            return answer(False, f"{name}: {e}")
        try:
            return answer(True, await asyncio.to_thread(method, *args))
        except SessionError as e:
            return answer(False, str(e))

    return endpoint
