"""HTTP client for the rollout service's control API (used by the trainer's loop and by tools).

Every call has a timeout and raises ``RolloutError`` naming the endpoint and the service's
message on failure; calls that are safe to repeat (status, engines, pause, resume) are retried on
connection errors, so a rollout service restart in the middle of a run is ridden out. With the run
token (``auth.token``) every call carries ``Authorization: Bearer <token>``.

A plain ``http://`` service that no proxy of the environment applies to is called over the
standard library's ``http.client`` (``_Conns``: kept-alive connections, JSON by orjson), any
other (``https://``, a proxy in ``HTTP_PROXY`` / ``ALL_PROXY`` not bypassed by ``NO_PROXY``)
through httpx as before. In ``bench/rollout_bench.py`` httpx's own work was ~0.7 ms of the ~1.1 ms
between the trainer's ``generate_batch`` call and the service's reading of it plus the answer's
way back (traced; ~0.25 ms with ``http.client``). A kept-alive connection is reused only while it
has been idle less than ``KEEPALIVE_S`` and has nothing to read (a server that closed it shows an
end of file): no request is written to a connection the server had closed when the call began,
so a call that is not repeated (``generate_batch``) is not lost to a stale connection (one closed
at the very moment the request leaves fails the call, as with httpx).
"""

from __future__ import annotations

import http.client
import select
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from headrace.shared.auth import bearer_headers
from headrace.shared.weight_sync.protocol import EngineTarget

KEEPALIVE_S = 4.0   # reuse a connection idle at most this long (uvicorn closes idle ones after 5 s)
_TRANSPORT_ERRORS = (httpx.TransportError, OSError, http.client.HTTPException)


class RolloutError(RuntimeError):
    """The rollout service answered an error or could not be reached."""


class _Conns:
    """Kept-alive ``http.client`` connections to one plain-http service; safe across threads (each
    call takes its own connection from the idle ones, or a new one)."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.headers = {"content-type": "application/json", **headers}
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()
        self.opened = 0   # connections made (tests read it)

    def _take(self, timeout: float) -> http.client.HTTPConnection:
        now = time.monotonic()
        while True:
            with self._lock:
                conn, since = self._idle.pop() if self._idle else (None, 0.0)
            if conn is None:
                self.opened += 1
                return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            sock = conn.sock
            if sock is not None and now - since < KEEPALIVE_S and not select.select([sock], [], [], 0)[0]:
                sock.settimeout(timeout)
                return conn
            conn.close()   # idle too long, or closed by the server (an end of file to read)

    def request(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        """The answer's status and body; ``OSError`` / ``http.client.HTTPException`` when the
        exchange failed (the connection is then closed, never reused)."""
        conn = self._take(timeout)
        try:
            conn.request(method, path, body=body, headers=self.headers)
            resp = conn.getresponse()
            data = resp.read()
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            with self._lock:
                self._idle.append((conn, time.monotonic()))
        return resp.status, data

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


def _lean(url: str, headers: dict[str, str]) -> _Conns | None:
    """``_Conns`` for ``url`` when it is plain http and no proxy of the environment applies to it."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path.strip("/"):
        return None
    proxies = urllib.request.getproxies()
    if (proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(parts.hostname):
        return None
    return _Conns(parts.hostname, parts.port or 80, headers)


class RolloutClient:
    def __init__(self, url: str, timeout: float = 600.0, retries: int = 30, backoff_s: float = 0.5,
                 token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout = timeout
        self._conns = _lean(self.url, bearer_headers(token))
        self._http = None if self._conns is not None else \
            httpx.Client(base_url=self.url, timeout=timeout, headers=bearer_headers(token))

    def _send(self, method: str, path: str, body: Any, timeout: float | None) -> tuple[int, bytes]:
        if self._http is None:
            assert self._conns is not None
            return self._conns.request(method, path, None if body is None else orjson.dumps(body), timeout or self.timeout)
        resp = self._http.request(method, path, json=body, timeout=timeout or httpx.USE_CLIENT_DEFAULT)
        return resp.status_code, resp.content

    def _call(self, method: str, path: str, body: Any = None, *, retry: bool = True, timeout: float | None = None) -> Any:
        attempts = self.retries if retry else 1
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                status, content = self._send(method, path, body, timeout)
            except _TRANSPORT_ERRORS as e:
                last = e
                if attempt + 1 < attempts:
                    time.sleep(min(5.0, self.backoff_s * (2 ** attempt)))
                continue
            if status >= 400:
                raise RolloutError(f"{method} {self.url}{path}: {status} {content.decode('utf-8', 'replace')[:500]}")
            return orjson.loads(content) if content else None
        raise RolloutError(f"{method} {self.url}{path}: unreachable after {attempts} attempts "
                           f"({type(last).__name__}: {last})")

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    def engines(self) -> list[EngineTarget]:
        return [EngineTarget(url=e["url"], world_size=int(e.get("world_size", 1))) for e in self._call("GET", "/v1/engines")]

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        return self._call("POST", "/v1/pause", {"mode": mode})

    def resume(self, weight_version: int) -> dict[str, Any]:
        return self._call("POST", "/v1/resume", {"weight_version": weight_version})

    def load_adapter(self, path: str, weight_version: int) -> dict[str, Any]:
        """``trainer.lora_sync: adapter``: every engine loads the PEFT directory ``path`` as
        ``v<weight_version>`` (repeatable: engines that have it are skipped); 502 names failing engines."""
        return self._call("POST", "/v1/load_adapter", {"path": path, "weight_version": weight_version})

    def generate_batch(self, groups: int, weight_version: int | None = None) -> dict[str, Any]:
        """On-demand: ``groups`` new groups into the buffer. ``weight_version`` names the weights the
        engines serve (the caller synced them); without it the service asks every engine."""
        body: dict[str, Any] = {"groups": groups}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._call("POST", "/v1/generate_batch", body, retry=False)

    def release_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/release_memory", {"tags": tags or ["weights", "kv_cache"]})

    def resume_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/resume_memory", {"tags": tags or ["weights", "kv_cache"]})

    def evaluate(self, n: int | None = None, part: tuple[int, int] | None = None) -> dict[str, Any]:
        """Score the current policy on the held-out prompts: ``{"score", "reward_mean", "n", ...}``;
        ``part`` (i, k): on prompts i, i + k, ... of them only."""
        return self._call("POST", "/v1/evaluate", {"n": n, **({"part": list(part)} if part else {})}, retry=False)

    def close(self) -> None:
        if self._conns is not None:
            self._conns.close()
        if self._http is not None:
            self._http.close()
