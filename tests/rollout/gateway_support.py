"""Helpers for the agent-gateway tests (no tests here): a buffer + rollout stack that runs with a
run token (``TokenStack``), and opening episodes over HTTP the way an external agent does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from headrace.shared.client import BufferClient
from headrace.shared.schemas import Group
from tests.procs import Proc, child_env, headrace_cmd
from tests.rollout.support import Stack

TOKEN = "gateway-test-token-0123456789"


class TokenStack(Stack):
    """``Stack`` with HEADRACE_TOKEN set for the buffer and the rollout service (and sent by ``call``)."""

    def start_buffer(self) -> None:
        self.buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(self.buffer_port), "--db",
                                        str(self.tmp / "buffer.sqlite")), self.tmp / "buffer.log",
                           env=child_env(HEADRACE_TOKEN=TOKEN))
        self.buffer.wait_http(f"{self.buffer_url}/health", timeout=60)

    def start_rollout(self) -> None:
        self.starts += 1
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port)), self.tmp / f"rollout-{self.starts}.log",
                            env=child_env(HEADRACE_LOG_LEVEL="INFO", HEADRACE_TOKEN=TOKEN))
        self.rollout.wait_http(f"{self.url}/health", timeout=240)

    def call(self, method: str, path: str, body: Any = None, token: str | None = TOKEN) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, f"{self.url}{path}", json=body, headers=headers, timeout=300)

    def get(self, path: str) -> Any:
        r = self.call("GET", path)
        r.raise_for_status()
        return r.json()

    def open_episode(self, **body: Any) -> dict[str, Any]:
        r = self.call("POST", "/v1/episodes", body)
        assert r.status_code == 200, r.text
        return r.json()

    def finish(self, episode_id: str, reward: float | None = None) -> dict[str, Any]:
        r = self.call("POST", f"/v1/episodes/{episode_id}/finish", {} if reward is None else {"reward": reward})
        assert r.status_code == 200, r.text
        return r.json()

    def buffer_groups(self) -> list[Group]:
        """Lease and ack everything queued in the buffer."""
        return self.lease_all(TOKEN)

    def buffer_stats(self) -> dict[str, Any]:
        with BufferClient(self.buffer_url, token=TOKEN) as c:
            return c.stats().model_dump()


def write_tasks(path: Path, n: int) -> Path:
    """Calculator tasks: ``{"prompt": "What is a + b?", "label": "<sum>"}``."""
    import json

    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i + 2}?", "label": str(2 * i + 2)}) + "\n"
                            for i in range(n)))
    return path
