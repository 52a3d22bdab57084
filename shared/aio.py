"""The asyncio HTTP client of the services' hot paths: engine ``/generate`` calls (rollout/transport.py)
and the rollout service's pushes to the buffer (``shared.client.AsyncBufferClient``).

It is aiohttp, not httpx: against the same server a request cost ~0.7 ms of the caller's CPU with
aiohttp and 2.0-3.0 ms with httpx on the 2-core machine (httpx's connection pool rescans every
pooled connection, checking each socket, on every request; anyio and h11 add the rest). In a
profile of the rollout service at 16 new tokens per sequence, httpx was a quarter of its busy time.

Guarantees of ``AioHTTP.request(method, url, content, headers, timeout_s)``:
- it returns a ``Reply``: ``status_code``, ``content`` (the whole body), ``headers`` (looked up
  case-insensitively) and ``text``, whatever the status;
- a failure raises the httpx exception that callers of an httpx client already handle (all are
  ``httpx.TransportError``): ``httpx.ConnectError`` (refused, unresolvable), ``httpx.ReadTimeout``
  (no answer within ``timeout_s``; ``min(5 s, timeout_s)`` to connect), ``httpx.ReadError``
  (connection lost, reset, body cut short);
- the ``headers`` given at construction go with every request (e.g. the run token); keep-alive
  connections are kept 2 s and their number is not capped; proxy variables of the environment
  are not used (these are calls between a run's own services);
- the session is opened on first use, in the running event loop; ``close()`` closes it (a later
  request opens a new one).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Mapping

import aiohttp
import httpx
import orjson

__all__ = ["AioHTTP", "Reply"]


class Reply:
    """An answer: status, body and headers."""

    __slots__ = ("status_code", "content", "headers")

    def __init__(self, status_code: int, content: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.status_code, self.content, self.headers = status_code, content, headers if headers is not None else {}

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class AioHTTP:
    """One aiohttp session (see the module docstring)."""

    def __init__(self, headers: Mapping[str, str] | None = None, connect_s: float = 5.0) -> None:
        self.headers = dict(headers or {})
        self.connect_s = connect_s
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def session(self) -> aiohttp.ClientSession:
        """The open session (made now when there is none; needs the running loop)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                                                  headers=self.headers, trust_env=False)
        return self._session

    def _timeout(self, timeout_s: float) -> aiohttp.ClientTimeout:
        t = self._timeouts.get(timeout_s)
        if t is None:
            t = self._timeouts[timeout_s] = aiohttp.ClientTimeout(
                total=None, sock_connect=min(self.connect_s, timeout_s), sock_read=timeout_s)
        return t

    async def request(self, method: str, url: str, content: bytes | None = None,
                      headers: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> Reply:
        session = self.session()
        try:
            async with session.request(method, url, data=content, headers=headers,
                                       timeout=self._timeout(timeout_s)) as r:
                return Reply(r.status, await r.read(), r.headers)
        except asyncio.TimeoutError as e:   # aiohttp's timeouts are asyncio.TimeoutError subclasses
            raise httpx.ReadTimeout(f"{method} {url}: no answer within {timeout_s} s") from e
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(f"{method} {url}: {type(e).__name__}: {e}") from e
        except (aiohttp.ClientError, OSError) as e:   # disconnected, reset, body cut short
            raise httpx.ReadError(f"{method} {url}: {type(e).__name__}: {e}") from e

    async def post_json(self, url: str, body: Any, timeout_s: float = 30.0) -> Reply:
        """POST ``body`` as JSON (orjson; what it cannot encode goes through the stdlib's encoder)."""
        try:
            data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError:
            data = json.dumps(body).encode()
        return await self.request("POST", url, data, {"content-type": "application/json"}, timeout_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
