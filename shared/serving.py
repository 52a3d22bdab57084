"""Serving an ASGI app so that it stops when asked: a bounded graceful shutdown, a hard deadline
after SIGTERM / SIGINT, a request-body bound, and a watchdog that ends a child whose parent died.

Guarantees:
- ``serve(app, ...)`` runs uvicorn. On SIGTERM or SIGINT open requests get ``graceful_s`` to
  finish, then they are cancelled and the app's shutdown runs; whatever still blocks (a
  torch.distributed rendezvous in a worker thread, a model step, a shutdown hook) cannot hold the
  process: ``deadline_s`` after the signal it exits (``os._exit``) with a line on stderr.
- ``BodyLimit`` answers 413 to a request whose body exceeds ``max_bytes`` (by Content-Length at
  once, or while counting a chunked body) before the app sees it; the app gets the body replayed
  and later ``receive()`` calls (disconnect detection) pass through.
- What the process allocated before ``serve`` starts the server (libraries, a model, config) is
  moved out of the cyclic garbage collector's reach (``gc.freeze``, after one collection), unless
  ``freeze_heap=False``: otherwise every full collection walks those millions of objects again.
  In the reference engine under ``bench/rollout_bench.py`` that was a 95-140 ms stall about every
  1.5 s, in the middle of answering a batch. Cyclic garbage made later is collected as before.
- ``keep_freed_memory()`` (glibc only; elsewhere it does nothing and says so) makes ``malloc``
  serve blocks below 32 MiB from the heap and keep up to 128 MiB of freed heap: a service that
  receives MB-sized bodies then reuses memory instead of mapping fresh zeroed pages for every body
  (glibc's default maps each block over 128 KiB anew; the buffer's 1 MB ingest spent ~1 ms a
  request in those page faults). The process's resident size may stay up to that much higher.
- ``watch_parent(pid)`` sends this process SIGTERM (so the deadline above applies) once its parent
  is no longer ``pid``: a launcher killed with SIGKILL leaves no engine behind.
Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Awaitable, Callable

import orjson

log = logging.getLogger("headrace.serving")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

GRACEFUL_S = 2.0     # open requests finish within this after a signal, or are cancelled
DEADLINE_S = 8.0     # the process is gone this long after the signal, whatever blocks


def _arm_deadline(deadline_s: float, name: str) -> None:
    def force() -> None:
        sys.stderr.write(f"{name}: still running {deadline_s:g} s after the stop signal; exiting now\n")
        sys.stderr.flush()
        os._exit(0)

    t = threading.Timer(deadline_s, force)
    t.daemon = True
    t.start()


def serve(app: Any, host: str, port: int, *, log_level: str = "warning", name: str = "headrace",
          graceful_s: float = GRACEFUL_S, deadline_s: float = DEADLINE_S, freeze_heap: bool = True,
          **uvicorn_kw: Any) -> None:
    """``uvicorn.run`` with a bounded shutdown and the heap so far frozen (see the module
    docstring); blocks."""
    import uvicorn

    class Server(uvicorn.Server):
        armed = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.armed:
                self.armed = True
                _arm_deadline(deadline_s, name)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=graceful_s, **uvicorn_kw)
    if freeze_heap:
        gc.collect()
        gc.freeze()
    Server(config).run()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 128 << 20) -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` for this process (see the module
    docstring); True when both took effect, False where there is no glibc ``mallopt``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version   # only glibc has it: musl's and macOS's allocators are left alone
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no glibc mallopt here: the allocator keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Start a daemon thread that SIGTERMs this process once its parent is not ``parent_pid`` any
    more (the parent died and this process was re-parented). If it already is not, at once."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        log.warning("parent process %d is gone; stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``; ``shape(message)`` is the JSON answer."""

    def __init__(self, app: Any, max_bytes: int, what: str,
                 shape: Callable[[str], Any] = lambda m: {"detail": m}) -> None:
        self.app, self.max_bytes, self.what, self.shape = app, max_bytes, what, shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send)
            return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":       # disconnected while sending the body
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        mb = self.max_bytes / (1024 * 1024)
        body = orjson.dumps(self.shape(f"request body too large: the limit is {mb:g} MiB ({self.what})"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
