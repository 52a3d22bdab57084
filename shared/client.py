"""HTTP clients of the buffer service: ``BufferClient`` (sync, the trainer) and
``AsyncBufferClient`` (asyncio, the rollout service). Same methods, same semantics.

Retry policy (every method but ``health``): connection errors, timeouts, 5xx and 429 are retried
up to ``retries`` times with exponential backoff (``backoff_s`` doubling, capped at
``max_backoff_s``, with jitter); a 429 waits for its ``Retry-After`` instead. Other 4xx answers are
raised at once as ``BufferError`` carrying the status and the server's message. Retries are safe:

- POST /v1/groups is idempotent because the buffer dedupes by ``Sample.uid`` and ``group_id`` (a
  retry of a POST that was committed reports duplicates and stores nothing twice);
- ack, release, extend, reject and policy-version updates are idempotent on the server;
- a lease whose answer was lost in transit is not delivered to anyone: its groups return to the
  queue when it expires, or at once if the buffer restarted.

Bodies go as msgpack (``msgpack=True``, the default, also asking for msgpack answers) or JSON.
With ``columns=True`` (the default; needs ``msgpack``) groups travel in the columnar format
(``shared.columns``) both ways: ``post_groups`` sends columns (rows only when a value cannot be
carried exactly, so the buffer's row schema names it), and leases are asked for in columns and
validated with numpy on arrival. ``lease_columns`` returns those columns as they are (no Python
objects per token); ``lease`` builds ``Group`` models from them without validating again.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Iterable

import httpx

from headrace.shared import columns as cols
from headrace.shared import wire
from headrace.shared.aio import AioHTTP, Reply
from headrace.shared.eager_http import EagerHTTP
from headrace.shared.schemas import BufferStats, Group, LeaseResponse, PostGroupsResponse, Sample

__all__ = ["BufferError", "BufferClient", "AsyncBufferClient", "LeaseColumns"]


class BufferError(RuntimeError):
    """A buffer request failed. ``status`` is the HTTP status (0: no answer), ``message`` the server's text."""

    def __init__(self, status: int, message: str, method: str = "", path: str = "") -> None:
        self.status = status
        self.message = message
        self.method = method
        self.path = path
        where = f"{method} {path}: " if method else ""
        super().__init__(f"{where}{status or 'no answer'}: {message}")


RETRY_STATUS = {429, 500, 502, 503, 504}


def _group_payload(groups: Iterable[Group | dict[str, Any]]) -> dict[str, Any]:
    out = []
    for g in groups:
        out.append(g.model_dump(mode="json") if isinstance(g, Group) else g)
    return {"groups": out}


@dataclass
class LeaseColumns:
    """A lease answered in columns: validated on arrival (``shared.columns.decode``)."""

    lease_id: str
    columns: cols.Columns
    expires_at: float

    @property
    def num_groups(self) -> int:
        return self.columns.num_groups


def _lease_result(out: Any, validate: bool) -> LeaseResponse | None:
    """A lease answer as models; ``validate=False`` trusts the buffer (it validated every group on
    ingest) and skips the second validation, ~2x faster for large groups. A columnar answer was
    validated when it was decoded: its models are built without validating again."""
    if out is None:
        return None
    if isinstance(out, LeaseColumns):
        return LeaseResponse.model_construct(lease_id=out.lease_id, groups=out.columns.to_groups(),
                                             expires_at=out.expires_at)
    if validate:
        return LeaseResponse.model_validate(out)
    groups = [Group.model_construct(group_id=g["group_id"], metadata=g.get("metadata") or {},
                                    samples=[Sample.model_construct(**s) for s in g["samples"]])
              for g in out["groups"]]
    return LeaseResponse.model_construct(lease_id=out["lease_id"], groups=groups, expires_at=out["expires_at"])


def _as_columns(out: Any) -> LeaseColumns | None:
    if out is None or isinstance(out, LeaseColumns):
        return out
    rows = LeaseResponse.model_validate(out)  # the buffer answered rows (columns cannot carry them exactly)
    return LeaseColumns(rows.lease_id, cols.from_rows(rows.groups), rows.expires_at)


def _extend_body(lease_s: float, trained: bool) -> dict[str, Any]:
    return {"lease_s": float(lease_s), "trained": bool(trained)}


def _reject_body(group_ids: list[str], reason: str) -> dict[str, Any]:
    return {"group_ids": list(group_ids), "reason": reason}


def _dead_letters_path(after: int | None) -> str:
    return "/v1/dead_letters" if after is None else f"/v1/dead_letters?after={after}"


def _retry_after(resp: httpx.Response | Reply) -> float | None:
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _message(resp: httpx.Response | Reply) -> str:
    try:
        body = wire.decode_answer(resp.content, resp.headers.get("content-type"))
    except wire.WireError:
        return resp.text[:2000]
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if key in body:
                return str(body[key])
    return str(body)[:2000]


class _Base:
    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0, retries: int = 8,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0, msgpack: bool = True,
                 columns: bool = True) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0 (got {retries})")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.msgpack = msgpack
        self.columns = columns and msgpack
        self.headers = {"accept": wire.MSGPACK if msgpack else wire.JSON}
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        self.lease_headers = {**self.headers, "accept": f"{cols.COLUMNS}, {wire.MSGPACK}"} if self.columns else None

    def _delay(self, attempt: int, resp: httpx.Response | Reply | None) -> float:
        if resp is not None and resp.status_code == 429:
            ra = _retry_after(resp)
            if ra is not None:
                return ra
        base = min(self.max_backoff_s, self.backoff_s * (2 ** attempt))
        return base * (0.5 + random.random() / 2)

    def _prepare(self, body: Any, headers: dict[str, str] | None = None) -> tuple[bytes | None, dict[str, str]]:
        headers = headers or self.headers
        if body is None:
            return None, headers
        if isinstance(body, bytes):  # already columns
            return body, {**headers, "content-type": cols.COLUMNS}
        content, ctype = wire.encode_request(body, self.msgpack)
        return content, {**headers, "content-type": ctype}

    def _groups_body(self, groups: list[Group | dict[str, Any]]) -> Any:
        if self.columns:
            try:
                return cols.encode(groups)
            except cols.NotColumnar:
                pass  # sent as rows: the buffer's row schema names what is wrong
        return _group_payload(groups)

    @staticmethod
    def _should_retry(resp: httpx.Response | Reply) -> bool:
        return resp.status_code in RETRY_STATUS

    @staticmethod
    def _result(method: str, path: str, resp: httpx.Response | Reply) -> Any:
        if resp.status_code >= 400:
            raise BufferError(resp.status_code, _message(resp), method, path)
        if resp.status_code == 204 or not resp.content:
            return None
        if cols.is_columns(resp.headers.get("content-type")):
            c, top = cols.decode(resp.content, ("lease_id", "expires_at"))
            return LeaseColumns(str(top.get("lease_id")), c, float(top.get("expires_at", 0.0)))
        return wire.decode_answer(resp.content, resp.headers.get("content-type"))

    @staticmethod
    def _lease_body(groups: int, wait_s: float, lease_s: float, min_weight_version: int | None) -> dict[str, Any]:
        return {"groups": groups, "wait_s": wait_s, "lease_s": lease_s, "min_weight_version": min_weight_version}


class BufferClient(_Base):
    """Synchronous buffer client (httpx). Use as a context manager or call ``close()``."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0, retries: int = 8,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0, msgpack: bool = True,
                 columns: bool = True) -> None:
        super().__init__(url, token, timeout, retries, backoff_s, max_backoff_s, msgpack, columns)
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                 headers: dict[str, str] | None = None) -> Any:
        content, headers = self._prepare(body, headers)
        last = ""
        for attempt in range(self.retries + 1):
            resp = None
            try:
                resp = self._http.request(method, path, content=content, headers=headers,
                                          timeout=timeout or self.timeout)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if not self._should_retry(resp) or attempt == self.retries:
                    return self._result(method, path, resp)
            if attempt < self.retries:
                time.sleep(self._delay(attempt, resp))
        raise BufferError(0, f"no answer after {self.retries + 1} attempts ({last})", method, path)

    def health(self) -> bool:
        """True when GET /health answers 200 (no retries)."""
        try:
            return self._http.get("/health", timeout=min(self.timeout, 5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def post_groups(self, groups: list[Group | dict[str, Any]]) -> PostGroupsResponse:
        """Store groups (all or nothing); committed when this returns."""
        return PostGroupsResponse.model_validate(self._request("POST", "/v1/groups", self._groups_body(groups)))

    def lease(self, groups: int, wait_s: float = 0.0, lease_s: float = 600.0,
              min_weight_version: int | None = None, validate: bool = True) -> LeaseResponse | None:
        """Lease exactly ``groups`` groups, waiting up to ``wait_s``; None when not available (204).

        ``validate=False`` builds the models without validating them again (the buffer validated
        them on ingest); use it on a hot path that trusts its buffer.
        """
        out = self._request("POST", "/v1/leases", self._lease_body(groups, wait_s, lease_s, min_weight_version),
                            timeout=self.timeout + wait_s, headers=self.lease_headers)
        return _lease_result(out, validate)

    def lease_columns(self, groups: int, wait_s: float = 0.0, lease_s: float = 600.0,
                      min_weight_version: int | None = None) -> LeaseColumns | None:
        """``lease``, answered as validated columns (numpy arrays, no Python object per token)."""
        out = self._request("POST", "/v1/leases", self._lease_body(groups, wait_s, lease_s, min_weight_version),
                            timeout=self.timeout + wait_s, headers=self.lease_headers)
        return _as_columns(out)

    def ack(self, lease_id: str) -> None:
        """Mark the lease's groups consumed (durable; idempotent). 409 if it expired, 404 if unknown."""
        self._request("POST", f"/v1/leases/{lease_id}/ack")

    def release(self, lease_id: str) -> None:
        """Return the lease's groups to the queue."""
        self._request("POST", f"/v1/leases/{lease_id}/release")

    def extend_lease(self, lease_id: str, lease_s: float, trained: bool = False) -> dict:
        """Move the lease's deadline to now + ``lease_s``; ``trained=True`` marks it held (trained, not
        yet checkpointed). Answers ``{"lease_id", "expires_at", "held"}``; 409 if it already expired
        or was settled, 404 if unknown. Idempotent, so retried like the others."""
        return self._request("POST", f"/v1/leases/{lease_id}/extend", _extend_body(lease_s, trained))

    def reject_lease(self, lease_id: str, group_ids: list[str], reason: str) -> dict:
        """Dead-letter ``group_ids`` of the lease (with ``reason``); its other groups go back to the head
        of the queue. Answers ``{"lease_id", "dead_lettered", "requeued"}``; a repeat answers 200 and
        changes nothing; 409 if the lease expired or was settled otherwise, 404 if unknown."""
        return self._request("POST", f"/v1/leases/{lease_id}/reject", _reject_body(group_ids, reason))

    def dead_letters(self) -> list[dict]:
        """Every dead-lettered group, oldest first: ``{"group_id", "lease_id", "reason", "at", ...}``
        (the buffer answers in pages; this follows them to the end)."""
        out: list[dict] = []
        after: int | None = None
        while True:
            page = self._request("GET", _dead_letters_path(after))
            out.extend(page["dead_letters"])
            after = page.get("next")
            if after is None:
                return out

    def set_policy_version(self, version: int) -> None:
        """Announce the trainer's policy version; the buffer evicts groups that became too stale."""
        self._request("PUT", "/v1/policy_version", {"version": version})

    def stats(self) -> BufferStats:
        return BufferStats.model_validate(self._request("GET", "/v1/stats"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "BufferClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBufferClient(_Base):
    """Asyncio buffer client (aiohttp, ``shared.aio``: a third of httpx's CPU per request; its
    failures are the httpx exceptions). Use as an async context manager or ``await close()``."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0, retries: int = 8,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0, msgpack: bool = True,
                 columns: bool = True) -> None:
        super().__init__(url, token, timeout, retries, backoff_s, max_backoff_s, msgpack, columns)
        self._http = AioHTTP()
        try:
            self._now: EagerHTTP | None = EagerHTTP(self.url, self.headers)
        except ValueError:   # not plain http (https, say): post_columns_now is not offered
            self._now = None

    async def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                       headers: dict[str, str] | None = None) -> Any:
        content, headers = self._prepare(body, headers)
        last = ""
        for attempt in range(self.retries + 1):
            resp = None
            try:
                resp = await self._http.request(method, self.url + path, content, headers, timeout or self.timeout)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if not self._should_retry(resp) or attempt == self.retries:
                    return self._result(method, path, resp)
            if attempt < self.retries:
                await asyncio.sleep(self._delay(attempt, resp))
        raise BufferError(0, f"no answer after {self.retries + 1} attempts ({last})", method, path)

    async def health(self) -> bool:
        try:
            return (await self._http.request("GET", self.url + "/health", None, self.headers,
                                             min(self.timeout, 5.0))).status_code == 200
        except httpx.HTTPError:
            return False

    async def post_groups(self, groups: list[Group | dict[str, Any]]) -> PostGroupsResponse:
        return PostGroupsResponse.model_validate(await self._request("POST", "/v1/groups", self._groups_body(groups)))

    async def post_columns(self, body: bytes) -> PostGroupsResponse:
        """``post_groups`` of a body already encoded as columns (``shared.columns``)."""
        return PostGroupsResponse.model_validate(await self._request("POST", "/v1/groups", body))

    @property
    def posts_now(self) -> bool:
        """Whether ``post_columns_now`` is offered (a plain ``http://`` buffer URL)."""
        return self._now is not None

    def post_columns_now(self, body: bytes) -> "asyncio.Future[Reply]":
        """One attempt of ``post_columns`` whose request is written before this returns, on a
        kept-alive connection (``shared.eager_http``: the buffer starts on it while the caller goes
        on). No retry here: the future fails as one attempt would (an httpx error), and
        ``posted(reply)`` reads its answer."""
        if self._now is None:
            raise RuntimeError("post_columns_now needs a plain http:// buffer URL (see posts_now)")
        return self._now.post("/v1/groups", body, {"content-type": cols.COLUMNS}, self.timeout)

    def posted(self, reply: Reply) -> PostGroupsResponse:
        """The answer of a ``post_columns_now``; ``BufferError`` for any status >= 400 (429 and 5xx
        included: retrying is the caller's)."""
        return PostGroupsResponse.model_validate(self._result("POST", "/v1/groups", reply))

    async def lease(self, groups: int, wait_s: float = 0.0, lease_s: float = 600.0,
                    min_weight_version: int | None = None, validate: bool = True) -> LeaseResponse | None:
        out = await self._request("POST", "/v1/leases", self._lease_body(groups, wait_s, lease_s, min_weight_version),
                                  timeout=self.timeout + wait_s, headers=self.lease_headers)
        return _lease_result(out, validate)

    async def lease_columns(self, groups: int, wait_s: float = 0.0, lease_s: float = 600.0,
                            min_weight_version: int | None = None) -> LeaseColumns | None:
        out = await self._request("POST", "/v1/leases", self._lease_body(groups, wait_s, lease_s, min_weight_version),
                                  timeout=self.timeout + wait_s, headers=self.lease_headers)
        return _as_columns(out)

    async def ack(self, lease_id: str) -> None:
        await self._request("POST", f"/v1/leases/{lease_id}/ack")

    async def release(self, lease_id: str) -> None:
        await self._request("POST", f"/v1/leases/{lease_id}/release")

    async def extend_lease(self, lease_id: str, lease_s: float, trained: bool = False) -> dict:
        return await self._request("POST", f"/v1/leases/{lease_id}/extend", _extend_body(lease_s, trained))

    async def reject_lease(self, lease_id: str, group_ids: list[str], reason: str) -> dict:
        return await self._request("POST", f"/v1/leases/{lease_id}/reject", _reject_body(group_ids, reason))

    async def dead_letters(self) -> list[dict]:
        out: list[dict] = []
        after: int | None = None
        while True:
            page = await self._request("GET", _dead_letters_path(after))
            out.extend(page["dead_letters"])
            after = page.get("next")
            if after is None:
                return out

    async def set_policy_version(self, version: int) -> None:
        await self._request("PUT", "/v1/policy_version", {"version": version})

    async def stats(self) -> BufferStats:
        return BufferStats.model_validate(await self._request("GET", "/v1/stats"))

    async def close(self) -> None:
        await self._http.close()
        if self._now is not None:
            await self._now.close()

    async def __aenter__(self) -> "AsyncBufferClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
