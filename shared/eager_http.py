"""Keep-alive HTTP/1.1 POSTs whose request is on the socket before ``post`` returns.

aiohttp (``shared.aio``) writes a request's body from a task of its own, so a request started in
the middle of a turn of the event loop leaves only at a later turn, after every callback already
queued for this one. When the rollout service's engines answer a batch, its 16-32 groups are built
in one such turn (~0.15 ms each on the 2-core machine); their pushes then all waited for that turn
to end and left as one POST, which the buffer decoded and stored while the service waited (~2-3 ms
for 28 groups). Written at once, a push of the first groups is stored by the buffer, on the other
core, while the service builds the rest.

Guarantees of ``EagerHTTP(base_url, headers).post(path, body, headers, timeout_s)``:
- when a kept-alive connection is idle, the whole request is written to it before ``post``
  returns; otherwise a connection is opened and the request written once it is up;
- it returns a future of the ``shared.aio.Reply`` (status, body, headers), whatever the status;
  failures are the httpx exceptions that ``shared.aio`` raises: ``httpx.ConnectError`` (refused,
  or not connected within ``connect_s``), ``httpx.ReadTimeout`` (no whole answer within
  ``timeout_s``), ``httpx.ReadError`` (connection lost, or an answer this client does not read:
  a malformed head, a head over 64 KiB, a body framed neither by ``Content-Length`` nor by chunks,
  a malformed chunk, bytes after the answer);
- a request that fails on a kept-alive connection before any byte of its answer arrived (the server
  closed the idle connection as the request left) is written once more on a new connection: use
  this client only for idempotent requests (POST /v1/groups is: the buffer dedupes by ids);
- connections idle for more than ``keepalive_s`` are closed rather than reused (uvicorn closes
  idle ones after 5 s); the headers given at construction go with every request;
- cancelling the future closes its connection (the server sees its client go away, as with
  aiohttp); ``close()`` closes every connection and cancels the futures of requests in flight.
A body of known length is kept as the pieces read and joined once (growing one buffer by every
piece cost the rollout service ~0.3 ms of CPU per 8 x 2,048-token group in ``bench/fleet_sim.py``).
Plain ``http://`` only (the run's services on loopback or a private network), no compression
asked for (none is then sent), no body read to the connection's close (uvicorn, SGLang and the
reference engine frame every answer by length).
"""

from __future__ import annotations

import asyncio
import time
from typing import Mapping
from urllib.parse import urlsplit

import httpx

from headrace.shared.aio import Reply

__all__ = ["EagerHTTP"]

_MAX_HEAD = 64 * 1024


class _Conn(asyncio.Protocol):
    """One connection, one request at a time."""

    def __init__(self, owner: "EagerHTTP") -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.buf = bytearray()
        self.waiter: asyncio.Future[Reply] | None = None
        self.retry: tuple[bytes, float] | None = None   # (request, timeout): may go once more elsewhere
        self.timer: asyncio.TimerHandle | None = None
        self.head: tuple[int, dict[str, str], int] | None = None   # status, headers, body length (-1: chunked)
        self.body = bytearray()   # a chunked answer's body so far
        self.parts: list[bytes] = []   # a body of known length: the pieces received (one copy when joined)
        self.got = 0
        self.idle_since = 0.0

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:
            self._drop(httpx.ReadError("bytes from the server with no request open"))
            return
        self.retry = None   # the answer has begun: this request is not sent again
        if self.head is not None and self.head[2] >= 0:   # a body of known length: its pieces, joined once
            self.parts.append(data)
            self.got += len(data)
        else:
            self.buf += data
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self._drop(httpx.ReadError(f"answer head over {_MAX_HEAD} bytes"))
                return
            try:
                self.head = _parse_head(bytes(self.buf[:end]))
            except ValueError as e:
                self._drop(httpx.ReadError(f"unreadable answer: {e}"))
                return
            del self.buf[:end + 4]
            if self.head[2] >= 0:
                self.parts, self.got = [bytes(self.buf)], len(self.buf)
                self.buf.clear()
        status, headers, length = self.head
        if length < 0:
            try:
                body = self._dechunk()
            except ValueError as e:
                self._drop(httpx.ReadError(f"unreadable chunked answer: {e}"))
                return
            if body is None:
                return
            extra = len(self.buf)
        else:
            if self.got < length:
                return
            extra = self.got - length
            body = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        if extra:
            self._drop(httpx.ReadError(f"{extra} bytes after the answer"))
            return
        reply = Reply(status, body, headers)
        waiter, self.waiter, self.head = self.waiter, None, None
        self.buf.clear()
        self.body.clear()
        self.parts, self.got = [], 0
        self._cancel_timer()
        if headers.get("connection", "").lower() == "close":
            self._close()
        else:
            self.owner._release(self)
        if not waiter.done():
            waiter.set_result(reply)

    def _dechunk(self) -> bytes | None:
        """Move whole chunks from ``buf`` to ``body``; the body once the last chunk (and the
        trailer) came, None while more is to come. ValueError for a malformed chunk."""
        while True:
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                if len(self.buf) > _MAX_HEAD:
                    raise ValueError("a chunk size line over 64 KiB")
                return None
            size_text = bytes(self.buf[:eol]).split(b";", 1)[0].strip()
            if not size_text or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
                raise ValueError(f"chunk size {size_text[:20]!r}")
            size = int(size_text, 16)
            if size == 0:   # the last chunk, then trailer lines (if any) and an empty line
                if len(self.buf) < eol + 4:
                    return None
                if self.buf[eol + 2:eol + 4] == b"\r\n":
                    end = eol + 4
                else:
                    end = self.buf.find(b"\r\n\r\n", eol + 2)
                    if end < 0:
                        return None
                    end += 4
                del self.buf[:end]
                return bytes(self.body)
            if len(self.buf) < eol + 2 + size + 2:
                return None
            if self.buf[eol + 2 + size:eol + 4 + size] != b"\r\n":
                raise ValueError("a chunk not followed by CRLF")
            self.body += self.buf[eol + 2:eol + 2 + size]
            del self.buf[:eol + 4 + size]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.owner._all.discard(self)
        self._cancel_timer()
        waiter, self.waiter = self.waiter, None
        retry, self.retry = self.retry, None
        if waiter is None or waiter.done():
            return
        if retry is not None:   # nothing of the answer came: the server closed the idle connection
            self.owner._open(retry[0], waiter, retry[1], again=False)
            return
        waiter.set_exception(httpx.ReadError(f"connection lost{f': {exc}' if exc else ''}"))

    # ---- used by EagerHTTP ----

    def send(self, request: bytes, waiter: asyncio.Future[Reply], timeout_s: float, again: bool) -> None:
        assert self.transport is not None and self.waiter is None, "one request at a time"
        self.waiter = waiter
        self.retry = (request, timeout_s) if again else None
        self.timer = asyncio.get_running_loop().call_later(timeout_s, self._timed_out, timeout_s)
        waiter.add_done_callback(self._given_up)
        self.transport.write(request)

    def _given_up(self, waiter: asyncio.Future[Reply]) -> None:
        """A caller that cancels its request closes the connection, as aiohttp does: the server sees
        the disconnect (SGLang and the reference engine abort the generation)."""
        if waiter.cancelled() and self.waiter is waiter:
            self.waiter = self.retry = None
            self._close()

    def usable(self, now: float, keepalive_s: float) -> bool:
        return (not self.closed and self.transport is not None and not self.transport.is_closing()
                and now - self.idle_since < keepalive_s)

    def _timed_out(self, timeout_s: float) -> None:
        self.timer = None
        self.retry = None
        self._drop(httpx.ReadTimeout(f"no whole answer within {timeout_s} s"))

    def _drop(self, error: Exception) -> None:
        """Fail the open request with ``error`` and close the connection."""
        waiter, self.waiter, self.retry = self.waiter, None, None
        self._close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _close(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _parse_head(head: bytes) -> tuple[int, dict[str, str], int]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isdigit() and len(parts[1]) == 3):
        raise ValueError(f"status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return int(parts[1]), headers, -1
    if "transfer-encoding" in headers:
        raise ValueError(f"transfer-encoding {headers['transfer-encoding'][:40]!r}")
    length = headers.get("content-length")
    if length is None or not length.isdigit():
        raise ValueError(f"Content-Length {length!r}")
    return int(parts[1]), headers, int(length)


class EagerHTTP:
    """Requests to one ``http://host:port`` (see the module docstring)."""

    def __init__(self, base_url: str, headers: Mapping[str, str] | None = None, connect_s: float = 5.0,
                 keepalive_s: float = 2.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"EagerHTTP takes a plain http://host[:port] URL, not {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        self.host_header = u.netloc
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        self.connect_s = connect_s
        self.keepalive_s = keepalive_s
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        # connections being opened -> the request waiting for each (held: the loop keeps only weak references)
        self._connecting: dict[asyncio.Task[None], asyncio.Future[Reply]] = {}

    def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None,
             timeout_s: float = 30.0) -> "asyncio.Future[Reply]":
        """POST ``body`` to ``path``; the future of its ``Reply`` (see the module docstring)."""
        fields = {**self.headers, **{k.lower(): v for k, v in (headers or {}).items()}}
        head = [f"POST {self.prefix}{path} HTTP/1.1", f"host: {self.host_header}",
                f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in fields.items() if k not in ("host", "content-length", "connection")]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        waiter: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self.keepalive_s):
                conn.send(request, waiter, timeout_s, again=True)
                return waiter
            conn._close()
        self._open(request, waiter, timeout_s, again=False)
        return waiter

    async def close(self) -> None:
        for task, waiter in list(self._connecting.items()):   # still connecting: cancelled with the request
            task.cancel()
            waiter.cancel()
        for conn in list(self._all):
            waiter, conn.waiter, conn.retry = conn.waiter, None, None
            conn._close()
            if waiter is not None:
                waiter.cancel()
        self._idle.clear()
        self._all.clear()

    def _open(self, request: bytes, waiter: asyncio.Future[Reply], timeout_s: float, again: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._connect(request, waiter, timeout_s, again))
        self._connecting[task] = waiter
        task.add_done_callback(lambda t: self._connecting.pop(t, None))

    async def _connect(self, request: bytes, waiter: asyncio.Future[Reply], timeout_s: float, again: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self), self.host, self.port), min(self.connect_s, timeout_s))
        except (OSError, asyncio.TimeoutError) as e:
            if not waiter.done():
                waiter.set_exception(httpx.ConnectError(f"POST {self.host}:{self.port}: {type(e).__name__}: {e}"))
            return
        if waiter.done():   # the caller gave up while connecting: keep the connection for the next
            self._release(conn)
            return
        self._all.add(conn)
        conn.send(request, waiter, timeout_s, again)

    def _release(self, conn: _Conn) -> None:
        self._all.add(conn)
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
