"""An httpx transport that serves an in-service agent's requests with the service's own ASGI app.

``ctx.client`` of an in-service agent talks to the rollout service it runs in. Over loopback, each
call paid for a TCP connection, HTTP/1.1 framing on both sides and the server's connection handling,
about half of the service's CPU per gateway call. ``AppTransport`` hands the request to the same
ASGI app uvicorn serves instead, in the calling task, without a socket.

Guarantees:
- The request goes through exactly what a socket request goes through inside the app: the body
  limit (``shared.serving.BodyLimit`` with ``rollout.max_body_mb``), authentication (the episode key
  under ``/openai/``, the run token elsewhere), strict validation, recording and the OpenAI answer
  and error shapes; the client sees the same status, headers and body bytes.
- The chat and text completion POSTs (``direct_routes``) skip the ASGI middleware and
  routing layers, which do nothing else for those paths: the transport applies the body limit
  itself (a body over it goes through the app, whose ``BodyLimit`` answers the 413) and calls the
  route's own handler; its response is sent through the same ASGI ``send``, so status, headers and
  body bytes are the ones the route answers over a socket. Other requests go through the whole app.
- Requests for any other origin than the service's own go out over the network as usual.
- One ``SharedClient`` serves every episode (an in-process transport holds no connections); an
  agent closing its client leaves it open for the others.
- An exception inside the app is a 500 (as uvicorn answers it), logged; a cancelled agent cancels
  its call (nothing is recorded: a call is recorded only once the engine answered).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable
from urllib.parse import unquote

log = logging.getLogger("headrace.rollout.gateway")

_ASGI = {"version": "3.0", "spec_version": "2.4"}
DIRECT_STATE = "gateway_direct_routes"   # app.state attribute: {path: handler}, set by ``routes.mount``


def direct_routes(app: Any) -> dict[str, Any]:
    """``{path: async handler(authorization, body) -> Response}`` for POSTs to the chat and text
    completion routes of ``app`` (``routes.mount`` publishes them), or ``{}``: when they are not
    mounted, or when the app has a middleware that does not declare ``passes_openai_through`` (the
    gateway's auth lets ``/openai/`` through untouched; another middleware might act on these paths)."""
    routes = getattr(getattr(app, "state", None), DIRECT_STATE, None)
    middleware = getattr(app, "user_middleware", None)
    if not routes or middleware is None or not all(getattr(m.cls, "passes_openai_through", False) for m in middleware):
        return {}
    return dict(routes)


def http_library() -> Any:
    """The HTTP library the installed ``openai`` SDK is built on: ``httpx2`` (openai 3), else
    ``httpx``. A client of the SDK's own library skips its conversions from legacy httpx objects."""
    import openai

    try:
        import httpx2
    except ImportError:
        httpx2 = None
    if httpx2 is not None and issubclass(openai.DefaultAsyncHttpxClient, httpx2.AsyncClient):
        return httpx2
    import httpx

    return httpx


class AppTransport:
    """Requests to ``origin`` (``http://host:port``) served by ``app`` in-process; others over the
    network. A transport of ``http`` (httpx or httpx2: the same transport interface)."""

    def __init__(self, app: Any, origin: str, http: Any, direct: Callable[[], dict[str, Any]] | None = None,
                 max_body: int | None = None) -> None:
        """``direct()``: the routes served without the ASGI layers (``direct_routes``), looked
        up at the first request (the routes are mounted by then); ``max_body``: the body limit of
        ``app`` (``BodyLimit``), which those requests must be under."""
        self.app = app
        self.http = http
        url = http.URL(origin)
        self.origin = (url.scheme, url.host, url.port)
        self.server = (url.host, url.port or 80)
        self._net: Any = None
        self._direct_fn = direct if max_body is not None else None
        self._direct: dict[str, Any] | None = None
        self.max_body = max_body if max_body is not None else -1

    async def __aenter__(self) -> "AppTransport":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def handle_async_request(self, request: Any) -> Any:
        url = request.url
        if (url.scheme, url.host, url.port) != self.origin:
            if self._net is None:
                self._net = self.http.AsyncHTTPTransport()
            return await self._net.handle_async_request(request)
        body = await request.aread()
        raw_path = url.raw_path
        path, _, query = raw_path.partition(b"?")
        scope = {"type": "http", "asgi": _ASGI, "http_version": "1.1", "method": request.method,
                 "scheme": url.scheme, "path": unquote(path.decode("ascii")), "raw_path": path,
                 "query_string": query, "root_path": "", "headers": [(k.lower(), v) for k, v in request.headers.raw],
                 "client": ("127.0.0.1", 0), "server": self.server, "state": {}}
        handler = None
        if request.method == "POST" and not query and len(body) <= self.max_body:
            if self._direct is None:
                self._direct = self._direct_fn() if self._direct_fn is not None else {}
            handler = self._direct.get(scope["path"])
        status, headers, chunks = 500, [], []
        started = False
        done = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers, started
            if message["type"] == "http.response.start":
                status, headers, started = message["status"], list(message.get("headers") or []), True
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    done.set()

        try:
            if handler is not None:   # as Starlette's Request.headers.get: the first one, latin-1
                auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
                response = await handler(auth, body)
                await response(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        except Exception:
            log.exception("in-process request %s %s failed", request.method, url.path)
            if not started:
                status, headers, chunks = 500, [(b"content-type", b"text/plain; charset=utf-8")], [b"Internal Server Error"]
        finally:
            done.set()
        return self.http.Response(status, headers=headers, content=b"".join(chunks), request=request)

    async def aclose(self) -> None:
        if self._net is not None:
            await self._net.aclose()


@functools.lru_cache(maxsize=None)
def shared_client_class(http: Any) -> Any:
    """``http.AsyncClient`` whose ``aclose`` leaves it open (``close_shared`` closes it)."""

    class SharedClient(http.AsyncClient):  # type: ignore[name-defined,misc]
        """The one HTTP client under every in-service episode's ``AsyncOpenAI``: an agent that
        closes its ``ctx.client`` does not close it for the other episodes."""

        async def aclose(self) -> None:
            return None

        async def close_shared(self) -> None:
            await super().aclose()

    return SharedClient
