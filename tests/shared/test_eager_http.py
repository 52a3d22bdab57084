"""``shared.eager_http`` against raw HTTP servers on loopback (real sockets, a thread per server).

Each server answers what a test scripts for every request, byte for byte, so framing, stale
kept-alive connections, cancellations and failures are exercised as they come off the wire.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Callable

import httpx
import pytest

from headrace.shared.eager_http import EagerHTTP

# (connection number, request number on it, the request's bytes) -> bytes to send; None: close the
# connection without answering; b"": answer nothing (hang); (bytes,): send them, then close
Script = Callable[[int, int, bytes], "bytes | tuple[bytes] | None"]


def ok(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra + \
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


class RawServer:
    """A loopback server running ``script``; records each connection's requests and its EOF."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[list[bytes]] = []    # per connection
        self.eof: list[threading.Event] = []     # set when the client closed that connection
        self.got_request = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests.append([])
            self.eof.append(threading.Event())
            threading.Thread(target=self._serve, args=(conn, len(self.requests) - 1), daemon=True).start()

    def _serve(self, conn: socket.socket, n: int) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        self.eof[n].set()
                        return
                    buf += data
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                while len(rest) < length:
                    rest += conn.recv(65536)
                request, buf = head + b"\r\n\r\n" + rest[:length], rest[length:]
                self.requests[n].append(request)
                self.got_request.set()
                answer = self.script(n, len(self.requests[n]) - 1, request)
                if answer is None:
                    return
                if isinstance(answer, tuple):
                    conn.sendall(answer[0])
                    return
                conn.sendall(answer)

    def close(self) -> None:
        self.sock.close()


def run(coro_fn: Callable[[], object]) -> object:
    return asyncio.run(coro_fn())  # type: ignore[arg-type]


def test_the_request_is_on_the_socket_before_post_returns() -> None:
    server = RawServer(lambda n, i, req: ok())

    async def main() -> None:
        client = EagerHTTP(server.url, {"authorization": "Bearer t"})
        await client.post("/v1/groups", b"first", {"content-type": "application/x-test"})   # opens the connection
        server.got_request.clear()
        fut = client.post("/v1/groups", b"second", {"content-type": "application/x-test"})
        # no await since post(): the event loop has not run, yet the server already has the request
        assert server.got_request.wait(5.0), "the request was not written before post returned"
        reply = await fut
        assert reply.status_code == 200 and reply.content == b'{"ok": true}'
        assert reply.headers["content-type"] == "application/json"
        await client.close()

    run(main)
    assert len(server.requests) == 1 and len(server.requests[0]) == 2   # one kept-alive connection
    head, _, body = server.requests[0][1].partition(b"\r\n\r\n")
    assert body == b"second"
    assert head.startswith(b"POST /v1/groups HTTP/1.1\r\n")
    assert b"authorization: Bearer t" in head and b"content-type: application/x-test" in head
    server.close()


_CHUNKED = (b"HTTP/1.1 422 Unprocessable Entity\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n")
_BIG = bytes(range(256)) * (3 * 4096 + 7)   # ~3 MB: many reads of the socket


@pytest.mark.parametrize("answer, status, body", [(_CHUNKED, 422, b"hello, world"), (ok(_BIG), 200, _BIG)],
                         ids=["any-status-chunked", "large-in-many-pieces"])
def test_an_answer_is_read_whole_and_the_connection_kept(answer: bytes, status: int, body: bytes) -> None:
    """Any status is a reply; a chunked answer (extensions, trailers) and a ~3 MB one arriving in
    many pieces are read whole, and the next request on the same connection finds nothing left over."""
    server = RawServer(lambda n, i, req: answer if i == 0 else ok(b"[]"))

    async def main() -> None:
        client = EagerHTTP(server.url)
        first = await client.post("/generate", b"{}")
        assert first.status_code == status and first.content == body
        second = await client.post("/generate", b"{}")   # the same connection, read to its end
        assert (second.status_code, second.content) == (200, b"[]")
        await client.close()

    run(main)
    assert [len(r) for r in server.requests] == [2]
    server.close()


def test_a_kept_alive_connection_the_server_closed_is_replaced_without_an_error() -> None:
    # the server closes every connection after answering, without saying so (no connection: close)
    def script(n: int, i: int, req: bytes) -> bytes | None:
        return ok() if i == 0 else None

    server = RawServer(script)

    async def main() -> None:
        client = EagerHTTP(server.url)
        for _ in range(3):
            assert (await client.post("/v1/groups", b"x")).status_code == 200
            await asyncio.sleep(0.05)
        await client.close()

    run(main)
    # each later request first met the closed connection (or found it closed), then a new one
    assert sum(len(r) for r in server.requests if r) >= 3
    assert all(len(r) <= 2 for r in server.requests)
    server.close()


def test_idle_connections_older_than_keepalive_are_not_reused() -> None:
    server = RawServer(lambda n, i, req: ok())

    async def main() -> None:
        client = EagerHTTP(server.url, keepalive_s=0.05)
        await client.post("/a", b"1")
        await client.post("/a", b"2")      # at once: the same connection
        await asyncio.sleep(0.1)
        await client.post("/a", b"3")      # idle too long: a new one
        await client.close()

    run(main)
    assert [len(r) for r in server.requests] == [2, 1]
    server.close()


def test_failures_are_the_httpx_errors_of_shared_aio() -> None:
    def script(n: int, i: int, req: bytes) -> "bytes | tuple[bytes] | None":
        path = req.split(b" ")[1]
        return {b"/hang": b"", b"/cut": (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",),
                b"/nolength": b"HTTP/1.1 200 OK\r\n\r\nabc", b"/garbage": b"SMTP ready\r\n\r\n",
                b"/extra": ok(b"{}") + b"junk", b"/badchunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked"
                b"\r\n\r\nzz\r\n"}[path]

    server = RawServer(script)

    async def main() -> None:
        client = EagerHTTP(server.url)
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/hang", b"", timeout_s=0.3)
        # /cut: three bytes of ten, then the server closes the connection (after the answer began:
        # not sent again); the others: answers this client does not read
        for path in ("/cut", "/nolength", "/garbage", "/extra", "/badchunk"):
            with pytest.raises(httpx.ReadError):
                await asyncio.wait_for(client.post(path, b""), 5.0)
        await client.close()
        with socket.socket() as s:   # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(httpx.ConnectError):
            await EagerHTTP(f"http://127.0.0.1:{port}").post("/x", b"")

    run(main)
    server.close()


def test_a_cancelled_request_closes_its_connection() -> None:
    server = RawServer(lambda n, i, req: b"")   # never answers

    async def main() -> None:
        client = EagerHTTP(server.url)
        fut = client.post("/generate", b"{}", timeout_s=30.0)
        assert await asyncio.to_thread(server.got_request.wait, 5.0)
        fut.cancel()
        assert await asyncio.to_thread(server.eof[0].wait, 5.0), "the server never saw the client go away"
        await client.close()

    run(main)
    server.close()


def test_close_cancels_requests_in_flight() -> None:
    server = RawServer(lambda n, i, req: b"")

    async def main() -> None:
        client = EagerHTTP(server.url)
        await_first = client.post("/x", b"")
        assert await asyncio.to_thread(server.got_request.wait, 5.0)
        await client.close()
        assert await_first.cancelled()
        # a request still connecting when the client closes is cancelled too
        connecting = EagerHTTP(server.url)
        fut = connecting.post("/x", b"")
        await connecting.close()
        await asyncio.sleep(0.05)
        assert fut.cancelled()

    run(main)
    server.close()


@pytest.mark.parametrize("url", ["https://127.0.0.1:1", "ftp://h/", "127.0.0.1:80"])
def test_only_plain_http_urls(url: str) -> None:
    with pytest.raises(ValueError, match="plain http"):
        EagerHTTP(url)
