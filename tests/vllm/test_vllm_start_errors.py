"""Bad input at fleet start for ``backend: vllm`` (no vLLM needed: fake upstreams on loopback).

An engine URL that is not vLLM, a vLLM of another version, and a vLLM without dev mode (its RL
routes missing), without the token-in route, serving another model than the trainer's, or without
Headrace's weight-transfer engine (or its version route) each stop ``Fleet.start`` with one error that
names the engine and the fix. The adapter (``python -m headrace.rollout.vllm_backend``) is a real
child process; the fake upstream is a stdlib HTTP server in this process.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from headrace.rollout.fleet import Fleet
from headrace.shared.config_sections import EnginesConfig


def fake_upstream(routes: dict[str, tuple[int, dict]]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            status, body = routes.get(self.path.split("?")[0], (404, {"detail": "Not Found"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def upstream(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[str]:
    served = {"/v1/models": (200, {"data": [{"id": str(tiny_model)}]})}
    server = fake_upstream({**served, **request.param})
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


DEV = {"/version": (200, {"version": "0.32.0"}), "/is_paused": (200, {"is_paused": False}),
       "/inference/v1/generate": (405, {"detail": "Method Not Allowed"})}


@pytest.mark.parametrize("upstream, words", [
    ({"/health": (200, {})}, ["is not a vLLM server", "rollout.engines.urls"]),
    ({**DEV, "/version": (200, {"version": "0.31.2"})}, ["vLLM 0.31.2", "supports vLLM 0.32", "build_vllm_venv"]),
    ({"/version": (200, {"version": "0.32.0"})}, ["without dev mode", "VLLM_SERVER_DEV_MODE=1"]),
    ({**DEV, "/inference/v1/generate": (404, {})}, ["/inference/v1/generate", "--enable-scale-out"]),
    ({**DEV, "/v1/models": (200, {"data": [{"id": "other-model"}]})}, ["serves ['other-model']", "--model"]),
    ({**DEV, "/server_info": (200, {"vllm_config": {"weight_transfer_config": None}})},
     ["without Headrace's weight-transfer engine", """--weight-transfer-config '{"backend": "headrace"}'""",
      "build_vllm_venv"]),
    ({**DEV, "/weight_info": (404, {})}, ["does not report its weight version"]),
], indirect=["upstream"], ids=["not-vllm", "version", "no-dev-mode", "no-scale-out", "other-model", "no-transfer-engine",
                               "no-weight-info"])
def test_fleet_start_names_the_engine_and_the_fix(upstream: str, words: list[str], tiny_model: Path,
                                                  tmp_path: Path) -> None:
    cfg = EnginesConfig(backend="vllm", urls=[upstream], startup_timeout_s=120, restart=False)
    fleet = Fleet(cfg, str(tiny_model), tmp_path)

    async def start() -> None:
        await fleet.start()

    with pytest.raises(RuntimeError) as err:
        asyncio.run(start())
    msg = str(err.value)
    assert "engine 0" in msg
    for w in words:
        assert w in msg, msg


def test_launch_without_the_vllm_python_is_a_config_error(tiny_model: Path, tmp_path: Path) -> None:
    fleet = Fleet(EnginesConfig(backend="vllm"), str(tiny_model), tmp_path)
    with pytest.raises(ValueError, match="rollout.engines.python: backend vllm needs the python of the vLLM venv"):
        asyncio.run(fleet.start())
