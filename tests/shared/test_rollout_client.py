"""The rollout client is what light tools import: it must not pull in torch."""

from __future__ import annotations

import subprocess
import sys


def test_rollout_client_does_not_import_torch() -> None:
    code = ("import sys\n"
            "import headrace.shared.rollout_client\n"
            "from headrace.shared.weight_sync import EngineTarget, WeightSyncError, engines_from_rollout\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# ---- the plain-http transport (``_Conns``) against a real HTTP/1.1 server on loopback ----------

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

import pytest  # noqa: E402

from headrace.shared import rollout_client as rcmod  # noqa: E402
from headrace.shared.rollout_client import RolloutClient, RolloutError  # noqa: E402


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    connections = 0
    seen: list[tuple[str, str, str | None, bytes]]
    close_after_answer = False   # close the connection after each answer without saying so
    closed = 0

    def shutdown_request(self, request: object) -> None:
        super().shutdown_request(request)   # type: ignore[arg-type]
        self.closed += 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        self.server.seen.append((self.command, self.path, self.headers.get("authorization"), body))
        status, out = (404, b'{"detail": "no such thing"}') if self.path == "/missing" else \
            (200, json.dumps({"path": self.path, "got": json.loads(body) if body else None}).encode())
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
        self.wfile.flush()
        if self.server.close_after_answer:
            self.close_connection = True

    do_GET = do_POST = _answer


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.seen = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(srv: _Server, **kw: object) -> RolloutClient:
    return RolloutClient(f"http://127.0.0.1:{srv.server_address[1]}", token="s" * 32, **kw)   # type: ignore[arg-type]


def test_plain_http_calls_share_one_kept_alive_connection_with_the_token(server: _Server,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    c = _client(server)
    assert c._conns is not None
    assert c.generate_batch(3, 7) == {"path": "/v1/generate_batch", "got": {"groups": 3, "weight_version": 7}}
    assert c.status() == {"path": "/v1/status", "got": None}
    assert c.pause("drain")["got"] == {"mode": "drain"}
    assert server.connections == 1 and c._conns.opened == 1
    assert [(m, p) for m, p, _, _ in server.seen] == [("POST", "/v1/generate_batch"), ("GET", "/v1/status"),
                                                     ("POST", "/v1/pause")]
    assert all(a == "Bearer " + "s" * 32 for _, _, a, _ in server.seen)
    with pytest.raises(RolloutError, match=r"GET http://127\.0\.0\.1:\d+/missing: 404 .*no such thing"):
        c._call("GET", "/missing")
    c.close()


def test_a_connection_the_server_closed_or_left_idle_is_never_written_to(server: _Server,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that closes after answering (without a ``Connection: close``) and a connection idle
    past ``KEEPALIVE_S``: the next call, even one that is not retried (``generate_batch``), goes
    out once, on a new connection."""
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    server.close_after_answer = True
    c = _client(server, retries=1)
    for k in range(3):
        assert c.generate_batch(k + 1)["got"] == {"groups": k + 1}
        deadline = time.monotonic() + 10
        while server.closed <= k and time.monotonic() < deadline:   # closed by now (a close racing a
            time.sleep(0.005)                                         # request is what no client avoids)
    assert server.connections == 3 and len(server.seen) == 3   # each request once
    server.close_after_answer = False
    c.status()
    monkeypatch.setattr(rcmod, "KEEPALIVE_S", 0.0)
    c.status()
    assert server.connections == 5 and len(server.seen) == 5
    c.close()


def test_unreachable_and_proxied_services(monkeypatch: pytest.MonkeyPatch) -> None:
    from headrace.shared.procs import free_port

    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    c = RolloutClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01)
    with pytest.raises(RolloutError, match=r"POST .*/v1/generate_batch: unreachable after 1 attempts \(Connection"):
        c.generate_batch(1)
    with pytest.raises(RolloutError, match=r"unreachable after 2 attempts"):
        c.status()
    # a proxy the environment names for this host: httpx, which honours it, as before
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("no_proxy", "")
    assert RolloutClient("http://10.1.2.3:8000")._conns is None
    monkeypatch.setenv("no_proxy", "10.1.2.3")
    assert RolloutClient("http://10.1.2.3:8000")._conns is not None
    assert RolloutClient("https://10.1.2.3:8000")._conns is None
    assert RolloutClient("http://10.1.2.3:8000/prefix")._conns is None
