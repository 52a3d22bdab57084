"""HTTP fan-out of weight sync: one request per engine, posted concurrently (one daemon thread
each), and one wait that watches those answers together with rank 0's own work (a broadcast in
flight or joining the group), so neither side waits on the other.

Guarantees: every request is bounded by ``timeout_s``; an engine that answers an error (HTTP status
other than 200, or ``success: false``), drops the connection or does not answer in time raises
``WeightSyncError`` naming its URL; a local failure (rank 0's broadcast or join) names the
engines whose answers show which one broke, else every engine still pending. No torch here.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Sequence

import httpx

from headrace.shared.weight_sync.protocol import EngineTarget, WeightSyncError

__all__ = ["Fanout", "spawn", "engines_from_rollout"]


def spawn(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn`` in a daemon thread (a hung join must not keep the interpreter from exiting)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="weight-sync").start()
    return fut


def engines_from_rollout(rollout_url: str, *, token: str | None = None, timeout_s: float = 30.0) -> list[EngineTarget]:
    """The engines of a rollout service, from its ``GET /v1/engines`` (``[{"url","world_size"}]``)."""
    url = rollout_url.rstrip("/") + "/v1/engines"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise WeightSyncError(f"GET {url}: {resp.status_code}: {resp.text[:500]}")
    body = resp.json()
    if isinstance(body, dict) and "engines" in body:
        body = body["engines"]
    if not isinstance(body, list) or not body:
        raise WeightSyncError(f"GET {url}: expected a non-empty list of engines, got {str(body)[:300]}")
    try:
        return [EngineTarget(url=e["url"], world_size=int(e.get("world_size", 1))) for e in body]
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightSyncError(f"GET {url}: bad engine entry: {exc}") from exc


def _wait_works(works: list[Any]) -> str | None:
    """Wait for completed broadcast works and empty the list; the error, if one failed. No work
    stays referenced from a frame (a traceback must not keep the group's sockets alive)."""
    try:
        for w in works:
            w.wait()
    except Exception as exc:  # noqa: BLE001 - gloo/nccl errors name no engine
        return str(exc) or type(exc).__name__
    finally:
        works.clear()
    return None


class Fanout:
    """Requests to every engine of a sender, and the wait on their answers."""

    def __init__(self, engines: Sequence[EngineTarget], timeout_s: float, token: str | None = None) -> None:
        self.urls = [e.url for e in engines]
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s,
                                  limits=httpx.Limits(max_connections=4 * len(self.urls) + 4))

    def close(self) -> None:
        self._http.close()

    # -- one engine --

    def post(self, url: str, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return self.request("POST", url, path, body, timeout)

    def request(self, method: str, url: str, path: str, body: dict[str, Any] | None = None,
                timeout: float | None = None, ok_404: bool = False) -> dict[str, Any] | None:
        timeout = self.timeout_s if timeout is None else timeout
        try:
            resp = self._http.request(method, url + path, json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise WeightSyncError(f"{url}{path}: no answer within {timeout:g}s", [url]) from exc
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{url}{path}: {type(exc).__name__}: {exc or 'connection failed'}", [url]) from exc
        if resp.status_code == 404 and ok_404:
            return None
        try:
            data = resp.json()
        except ValueError:
            data = {"message": resp.text[:500]}
        if resp.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            message = data.get("message") or data.get("detail") or data if isinstance(data, dict) else data
            raise WeightSyncError(f"{url}{path}: HTTP {resp.status_code}: {str(message)[:500]}", [url])
        return data if isinstance(data, dict) else {"result": data}

    def weight_version(self, url: str) -> str | None:
        """The engine's weight_version from /get_model_info (/model_info, /get_server_info as fallbacks)."""
        for path in ("/get_model_info", "/model_info", "/get_server_info"):
            data = self.request("GET", url, path, timeout=min(self.timeout_s, 30.0), ok_404=True)
            if data is not None and "weight_version" in data:
                v = data["weight_version"]
                return None if v is None else str(v)
        raise WeightSyncError(f"{url}: neither /get_model_info, /model_info nor /get_server_info reports "
                              "weight_version", [url])

    # -- every engine --

    def each(self, path: str, body: dict[str, Any] | Sequence[dict[str, Any]],
             timeout: float | None = None) -> dict[str, Future]:
        """Post ``body`` (or ``body[i]`` to engine i) to every engine concurrently."""
        bodies = [body] * len(self.urls) if isinstance(body, dict) else list(body)
        return {url: spawn(self.post, url, path, b, timeout) for url, b in zip(self.urls, bodies)}

    def all(self, path: str, body: dict[str, Any], what: str) -> None:
        """Post to every engine and wait for every answer (WeightSyncError at the first failure)."""
        self.wait(self.each(path, body), what)

    def best_effort(self, path: str, body: dict[str, Any]) -> None:
        """Post to every engine and wait a bounded time, ignoring every answer (cleanup of state an
        earlier sender may have left; a dead engine is reported by the next real step)."""
        limit = min(self.timeout_s, 30.0)
        wait_futures(list(self.each(path, body, limit).values()), timeout=limit + 1)

    def wait(self, futures: dict[str, Future], what: str, *, works: list[Any] | None = None,
             local: Future | None = None) -> None:
        """Wait for every engine's answer, and for the broadcast ``works`` in flight (the list is
        emptied once they complete) or the ``local`` future; WeightSyncError at the first failure
        or after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        pending = dict(futures)
        broadcast = works is not None
        while True:
            waiting = list(pending.values()) + ([local] if local is not None else [])
            if waiting:
                wait_futures(waiting, timeout=0.002 if broadcast else 0.05, return_when="FIRST_COMPLETED")
            elif broadcast:
                time.sleep(0.0005)
            for url, fut in list(pending.items()):
                if fut.done():
                    exc = fut.exception()
                    if exc is not None:
                        raise exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"{what}: {url}: {exc}", [url])
                    del pending[url]
            if local is not None and local.done():
                exc = local.exception()
                if exc is not None:
                    self._raise_with_culprits(pending, f"{what}: trainer rank 0 failed: {exc}", deadline)
                local = None
            if broadcast and all(w.is_completed() for w in works):
                failure = _wait_works(works)
                if failure:
                    self._raise_with_culprits(pending, f"{what}: broadcast failed: {failure}", deadline)
                broadcast = False
            if not pending and not broadcast and local is None:
                return
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{what}: timed out after {self.timeout_s:g}s waiting for "
                                      f"{', '.join(pending) or 'the broadcast'}", list(pending) or self.urls)

    def _raise_with_culprits(self, pending: dict[str, Future], message: str, deadline: float) -> None:
        """A local failure names no engine: give the engines' answers a moment to say which one broke."""
        if pending:
            wait_futures(list(pending.values()), timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            for url, fut in pending.items():
                if fut.done() and fut.exception() is not None:
                    raise WeightSyncError(f"{message}; {fut.exception()}", [url])
        raise WeightSyncError(message, list(pending) or self.urls)
