"""The buffer HTTP service (FastAPI): the API of DESIGN.md "Buffer service HTTP API".

Guarantees:
- POST /v1/groups answers 200 only after the store committed the request (see store.py for what
  "committed" survives: ``buffer.durability``); 422 / 413 / 429 store nothing. Requests parsed
  while the store is busy are committed together (group commit: one transaction, one fsync), each
  answered after that commit, each all or nothing on its own.
- Every SQLite call of a durable store runs on one dedicated thread, and decoding + validation of
  row bodies and of column bodies over ``INLINE_PARSE_BYTES`` on a worker thread, so the event loop
  keeps answering (health, stats, other leases) meanwhile. An in-memory store (``buffer.memory``)
  is called on the event loop itself: it never waits for a disk, and its calls take microseconds
  to a few milliseconds, less than the two thread hand-offs per request (on the 2-core machine
  ~0.1 ms of the buffer's ~0.7 ms of CPU per POST of 8 small groups, and each hand-off a wake-up
  that waits for a core when the engines have both). A smaller column body is checked on the
  loop itself: numpy takes ~1 ms a MB there, less than the two thread hand-offs would add.
  A lease with ``wait_s`` waits on an asyncio condition, never on a thread.
- Leases past their ``expires_at`` go back to the queue lazily (on every lease/ack/release) and
  from a background task, so a waiting lease sees them promptly.
- With ``auth.token``, every endpoint but /health (and /metrics, unless ``auth.protect_metrics``)
  needs ``Authorization: Bearer <token>`` (``shared.auth.Guard``, as on every service).
- Answers are msgpack when the request's Accept asks for it, JSON otherwise; errors are
  ``{"detail": message}``. POST /v1/groups also takes ``application/x-headrace-columns`` bodies,
  and a lease asked with that Accept is answered in columns (DESIGN "Columnar wire format").
- Input is strict (``shared.schemas``): a body that is not JSON or msgpack is 415, anything that
  does not validate is 422 naming the field, and nothing is stored. A lease whose answer cannot
  be encoded is released before the 500, so no group is ever locked by its own answer.
- Prometheus labels come from fixed sets: the HTTP method (others count as ``other``), the route
  template, the status.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, AsyncIterator, Callable, TypeVar

import msgpack
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from headrace.buffer.ingest import parse_groups
from headrace.buffer.metrics import CONTENT_TYPE, BufferMetrics
from headrace.buffer.policy import BufferFull, LeaseConflict, LeaseNotFound, NotInLease
from headrace.buffer.store import GroupRow, Lease, PostResult, Store
from headrace.shared import column_blobs, columns, wire
from headrace.shared.auth import Guard
from headrace.shared.config import AuthConfig, BufferConfig
from headrace.shared.schemas import ExtendLeaseRequest, LeaseRequest, PolicyVersionRequest, RejectLeaseRequest

T = TypeVar("T")
log = logging.getLogger("headrace.buffer")
_EXPIRY_TICK_S = 0.5
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT"})  # the API's; any other counts as "other"
_MAX_DEAD_LETTERS_PAGE = 1000
INLINE_PARSE_BYTES = 4 << 20  # column bodies up to this are parsed on the event loop (see the docstring)


class _BodyTooLarge(Exception):
    pass


class _Post:
    """One request in the group-commit queue, and what the commit answered for it."""

    __slots__ = ("rows", "result")

    def __init__(self, rows: list[GroupRow]) -> None:
        self.rows = rows
        self.result: PostResult | BaseException | None = None


class BufferService:
    """Owns the store, its thread, the lease waiters and the metrics of one buffer."""

    def __init__(self, cfg: BufferConfig) -> None:
        self.cfg = cfg
        self.max_body = int(cfg.max_body_mb * 1024 * 1024)
        self.db_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="buffer-db")
        self.inline = cfg.memory   # an in-memory store is called on the event loop (module docstring)
        self.store: Store | None = None
        self.metrics = BufferMetrics(self.stats)
        self.changed = asyncio.Condition()
        self.generation = 0  # bumped whenever groups may have become leasable
        self.in_flight = 0  # HTTP requests being served
        self.waiting = 0  # of which leases waiting for groups (housekeeping runs when no other is in flight)
        self._posts: list[_Post] = []  # parsed POST /v1/groups waiting for the next group commit
        self._posts_lock = threading.Lock()

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a store call: on the store's thread, or here for an in-memory store."""
        if self.inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.db_thread, partial(fn, *args))

    async def start(self) -> None:
        path = None if self.cfg.memory else (self.cfg.db or "buffer.sqlite")
        self.store = await self.db(Store, path, self.cfg.capacity, self.cfg.max_staleness, self.cfg.durability)

    async def post(self, rows: list[GroupRow]) -> PostResult:
        """Store one request's groups by group commit: every request parsed while the store's thread
        was busy is stored by the next ``Store.post_many`` (one transaction, one commit), and each is
        answered after that commit. Raises ``BufferFull`` for this request alone."""
        mine = _Post(rows)
        with self._posts_lock:
            self._posts.append(mine)
        await self.db(self._commit_posts)   # FIFO (thread or inline): on return a commit holding ``mine`` is done
        if isinstance(mine.result, BaseException):
            raise mine.result
        assert mine.result is not None, "group commit left a request unanswered"
        return mine.result

    def _commit_posts(self) -> None:
        """As a store call (``db``): store every waiting request (none: an earlier call took them)."""
        assert self.store is not None
        with self._posts_lock:
            batch, self._posts = self._posts, []
        if not batch:
            return
        try:
            results: list[Any] = self.store.post_many([p.rows for p in batch])
        except Exception as e:  # the transaction failed: nothing of the batch is stored
            results = [e] * len(batch)
        for p, r in zip(batch, results):
            p.result = r

    async def stop(self) -> None:
        if self.store is not None:
            await self.db(self.store.close)
        self.db_thread.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        assert self.store is not None, "stats before start"
        return self.store.stats()

    async def notify(self) -> None:
        self.generation += 1
        async with self.changed:
            self.changed.notify_all()

    async def housekeeping(self) -> None:
        """Expire lapsed leases; when no request is in flight, delete payloads of consumed groups."""
        assert self.store is not None
        while True:
            await asyncio.sleep(_EXPIRY_TICK_S)
            try:
                await self._housekeeping_once()
            except Exception:  # keep the loop alive; the next tick retries
                log.exception("buffer housekeeping failed")

    async def _housekeeping_once(self) -> None:
        assert self.store is not None
        nxt = self.store.next_expiry()
        if nxt is not None and nxt < time.time() and await self.db(self.store.expire) > 0:
            await self.notify()
        while self.store.to_purge and self.in_flight <= self.waiting:
            await self.db(self.store.purge, 64)

    async def read_body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise _BodyTooLarge()
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise _BodyTooLarge()
            chunks.append(chunk)
        return b"".join(chunks)


def _error(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return wire.respond({"detail": message}, request.headers.get("accept"), status, headers)


def _lease_answer(lease: Lease, accept: str | None) -> Response:
    """Columns when asked for (stored column blobs concatenated, row blobs converted; rows that
    columns cannot carry exactly fall back to msgpack rows). Row answers splice stored msgpack row
    blobs straight into a msgpack answer; column blobs and JSON answers are decoded first."""
    if columns.is_columns(accept):
        try:
            body = column_blobs.pack_merged(lease.blobs, {"lease_id": lease.lease_id, "expires_at": lease.expires_at})
            return Response(body, media_type=columns.COLUMNS)
        except columns.NotColumnar:
            accept = wire.MSGPACK
    if wire.is_msgpack(accept):
        p = msgpack.Packer(use_bin_type=True)
        blobs = [b if b[:4] != columns.BLOB_MAGIC else p.pack(column_blobs.blob_rows(b)) for b in lease.blobs]
        parts = [p.pack_map_header(3), p.pack("lease_id"), p.pack(lease.lease_id), p.pack("groups"),
                 p.pack_array_header(len(blobs)), *blobs, p.pack("expires_at"), p.pack(lease.expires_at)]
        return Response(b"".join(parts), media_type=wire.MSGPACK)
    groups = [column_blobs.blob_rows(b) for b in lease.blobs]
    body = wire.dumps_json({"lease_id": lease.lease_id, "groups": groups, "expires_at": lease.expires_at})
    return Response(body, media_type=wire.JSON)


def _decode_model(model: Any, body: bytes, content_type: str | None) -> Any:
    wire.check_content_type(content_type)
    try:
        return model.model_validate(wire.decode_body(body, content_type))
    except ValidationError as e:
        raise wire.WireError(wire.format_validation_error(e)) from None


def create_app(cfg: BufferConfig, auth: AuthConfig | None = None) -> "_Edge":
    """The buffer's ASGI app (FastAPI routes wrapped by ``_Edge``); the store opens in its lifespan."""
    svc = BufferService(cfg)

    async def read_model(model: Any, request: Request) -> Any:
        """The request body as ``model``, or the 413/422 answer naming what is wrong."""
        try:
            return _decode_model(model, await svc.read_body(request), request.headers.get("content-type"))
        except wire.WireError as e:
            return _error(request, e.status, e.message)
        except _BodyTooLarge:
            return _error(request, 413, "request body too large")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await svc.start()
        task = asyncio.create_task(svc.housekeeping())
        try:
            yield
        finally:
            task.cancel()
            await svc.stop()

    app = FastAPI(title="Headrace buffer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = svc

    @app.get("/health")
    async def health(request: Request) -> Response:
        return wire.respond({"status": "ok"}, request.headers.get("accept"))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/groups")
    async def post_groups(request: Request) -> Response:
        store = svc.store
        assert store is not None
        try:
            body = await svc.read_body(request)
        except _BodyTooLarge:
            store.count("rejected")
            return _error(request, 413, f"request body exceeds --max-body-mb {cfg.max_body_mb:g} MiB")
        ctype = request.headers.get("content-type")
        try:
            if len(body) <= INLINE_PARSE_BYTES and columns.is_columns(ctype):
                rows = parse_groups(body, ctype)
            else:
                rows = await run_in_threadpool(parse_groups, body, ctype)
        except wire.WireError as e:
            store.count("rejected", getattr(e, "groups", 1))
            return _error(request, e.status, e.message)
        try:
            res = await svc.post(rows)
        except BufferFull as e:
            return _error(request, 429, str(e), {"Retry-After": str(e.retry_after_s)})
        svc.metrics.ingest_bytes.inc(len(body))
        if res.accepted:
            await svc.notify()
        return wire.respond({"accepted": res.accepted, "duplicates": res.duplicates,
                             "evicted_stale": res.evicted_stale}, request.headers.get("accept"))

    @app.post("/v1/leases")
    async def lease(request: Request) -> Response:
        store = svc.store
        assert store is not None
        req = await read_model(LeaseRequest, request)
        if isinstance(req, Response):
            return req
        deadline = time.monotonic() + req.wait_s
        while True:
            generation = svc.generation
            got = await svc.db(store.lease, req.groups, req.lease_s, req.min_weight_version)
            if got is not None:
                try:
                    return await run_in_threadpool(_lease_answer, got, request.headers.get("accept"))
                except Exception as e:  # validation makes this impossible; never lock groups if it happens
                    log.exception("lease %s could not be encoded; releasing it", got.lease_id)
                    await svc.db(store.release, got.lease_id)
                    await svc.notify()
                    return _error(request, 500, f"lease answer could not be encoded ({type(e).__name__}); released")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Response(status_code=204)
            async with svc.changed:
                if svc.generation != generation:
                    continue  # something changed while we were looking: look again
                svc.waiting += 1
                try:
                    await asyncio.wait_for(svc.changed.wait(), min(remaining, 1.0))
                except asyncio.TimeoutError:
                    pass
                finally:
                    svc.waiting -= 1

    async def on_lease(request: Request, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` as a store call (``BufferService.db``), or the answer naming why the lease
        refused it: 404 unknown lease, 409 not active any more, 422 groups that are not the lease's."""
        try:
            return await svc.db(fn, *args)
        except LeaseNotFound as e:
            return _error(request, 404, str(e))
        except LeaseConflict as e:
            return _error(request, 409, str(e))
        except NotInLease as e:
            return _error(request, 422, str(e))

    async def settle(request: Request, lease_id: str, action: str) -> Response:
        store = svc.store
        assert store is not None
        n = await on_lease(request, store.ack if action == "ack" else store.release, lease_id)
        if isinstance(n, Response):
            return n
        if action == "release" and n:
            await svc.notify()
        return wire.respond({"lease_id": lease_id, "groups": n}, request.headers.get("accept"))

    @app.post("/v1/leases/{lease_id}/ack")
    async def ack(request: Request, lease_id: str) -> Response:
        return await settle(request, lease_id, "ack")

    @app.post("/v1/leases/{lease_id}/release")
    async def release(request: Request, lease_id: str) -> Response:
        return await settle(request, lease_id, "release")

    @app.post("/v1/leases/{lease_id}/extend")
    async def extend(request: Request, lease_id: str) -> Response:
        store = svc.store
        assert store is not None
        req = await read_model(ExtendLeaseRequest, request)
        if isinstance(req, Response):
            return req
        out = await on_lease(request, store.extend, lease_id, req.lease_s, req.trained)
        if isinstance(out, Response):
            return out
        expires_at, held = out
        return wire.respond({"lease_id": lease_id, "expires_at": expires_at, "held": held}, request.headers.get("accept"))

    @app.post("/v1/leases/{lease_id}/reject")
    async def reject(request: Request, lease_id: str) -> Response:
        store = svc.store
        assert store is not None
        req = await read_model(RejectLeaseRequest, request)
        if isinstance(req, Response):
            return req
        out = await on_lease(request, store.reject, lease_id, req.group_ids, req.reason)
        if isinstance(out, Response):
            return out
        dead, requeued = out
        if requeued:
            await svc.notify()
        return wire.respond({"lease_id": lease_id, "dead_lettered": dead, "requeued": requeued},
                            request.headers.get("accept"))

    @app.get("/v1/dead_letters")
    async def dead_letters(request: Request) -> Response:
        store = svc.store
        assert store is not None
        try:
            after, limit = _page_params(dict(request.query_params), len(request.query_params.multi_items()))
        except wire.WireError as e:
            return _error(request, e.status, e.message)
        page, nxt = await svc.db(store.dead_letters, after, limit)
        return wire.respond({"dead_letters": page, "next": nxt}, request.headers.get("accept"))

    @app.put("/v1/policy_version")
    async def policy_version(request: Request) -> Response:
        store = svc.store
        assert store is not None
        req = await read_model(PolicyVersionRequest, request)
        if isinstance(req, Response):
            return req
        evicted = await svc.db(store.set_policy_version, req.version)
        return wire.respond({"policy_version": req.version, "evicted": evicted}, request.headers.get("accept"))

    @app.get("/v1/stats")
    async def stats(request: Request) -> Response:
        assert svc.store is not None
        return wire.respond(await svc.db(svc.store.stats), request.headers.get("accept"))  # between transactions

    return _Edge(app, svc, Guard.of(auth), {("POST", "/v1/groups"): post_groups})


def _page_params(params: dict[str, str], n_items: int) -> tuple[int, int]:
    """``after`` (cursor, default 0) and ``limit`` (1..1000, default 100), strictly: 422 otherwise."""
    unknown = sorted(set(params) - {"after", "limit"})
    if unknown or n_items != len(params):
        raise wire.WireError(f"{(unknown or ['after/limit'])[0][:40]}: unknown or repeated query parameter")
    out = []
    for key, default, hi in (("after", 0, 2**63 - 1), ("limit", 100, _MAX_DEAD_LETTERS_PAGE)):
        raw = params.get(key)
        if raw is None:
            out.append(default)
            continue
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 19) or not (key == "after" or int(raw) >= 1) \
                or int(raw) > hi:
            raise wire.WireError(f"{key}: must be an integer in [{0 if key == 'after' else 1}, {hi}]")
        out.append(int(raw))
    return out[0], out[1]


class _Edge:
    """Pure ASGI wrapper: bearer-token check and the latency histogram, around every request; the
    hot ingest route (POST /v1/groups) is called from here directly, the others through FastAPI."""

    def __init__(self, app: FastAPI, svc: BufferService, guard: Guard,
                 direct: dict[tuple[str, str], Callable[[Request], Any]] | None = None) -> None:
        self.app = app
        self.svc = svc
        self.guard = guard
        # (method, path) -> handler called here, past FastAPI's middleware and routing (~0.05-0.1
        # ms of a 1 MB ingest request); it handles its own errors and answers with a Response
        self.direct = direct or {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        if not self.guard.allows(scope):
            await self.guard.deny(scope, receive, send_status)
            self._observe(scope, "unauthorized", status[0], t0)
            return
        self.svc.in_flight += 1
        key = (scope["method"], scope["path"])
        handler = self.direct.get(key) if not scope.get("root_path") else None
        try:
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.svc.in_flight -= 1
            route = key[1] if handler is not None else getattr(scope.get("route"), "path", None) or "other"
            self._observe(scope, route, status[0], t0)

    def _observe(self, scope: dict[str, Any], route: str, status: int, t0: float) -> None:
        method = scope["method"] if scope["method"] in _METHODS else "other"
        self.svc.metrics.latency.labels(method, route, str(status)).observe(time.perf_counter() - t0)


def serve(cfg: BufferConfig, log_level: str = "warning", auth: AuthConfig | None = None) -> None:
    """Run the buffer in this process until SIGINT/SIGTERM: the store closes cleanly, and whatever
    blocks the shutdown cannot hold the process past ``shared.serving``'s deadline (every commit is
    already durable, so a forced exit loses nothing that was answered)."""
    from headrace.shared.serving import keep_freed_memory
    from headrace.shared.serving import serve as run

    keep_freed_memory()
    run(create_app(cfg, auth), cfg.host, cfg.port, log_level=log_level, name="buffer")
