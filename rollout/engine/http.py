"""JSON answers and request bodies for the reference engine's HTTP handlers."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON answer serialised with orjson."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def answer(ok: bool, message: str, **extra: Any) -> Response:
    """SGLang's answer of the weight and memory endpoints: ``{"success", "message"}``, 200 or 400."""
    return json_response({"success": ok, "message": message, **extra}, 200 if ok else 400)


async def json_body(request: Request) -> Any:
    """The parsed body (``{}`` when empty); ValueError when it is not JSON."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
