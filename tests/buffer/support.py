"""Helpers the buffer tests share: start a real ``headrace buffer serve``, build a valid group,
lease and read stats over HTTP. Plain functions; the fixtures are in the test modules that use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.procs import Proc, free_port, headrace_cmd


def start_buffer(log_dir: Path, *args: str, name: str = "buffer", port: int | None = None) -> tuple[Proc, str]:
    """Start `headrace buffer serve ARGS` on a free port; returns the process and its URL."""
    port = port or free_port()
    proc = Proc(headrace_cmd("buffer", "serve", "--port", str(port), *args), log_dir / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=60)
    except Exception:
        proc.stop()
        raise
    return proc, url


def make_group(gid: str, n: int = 2, prompt: int = 3, response: int = 4, wv: int = 0,
               reward: float = 1.0) -> dict[str, Any]:
    """A valid group as a plain dict (what a producer sends)."""
    return {"group_id": gid, "metadata": {"k": gid}, "samples": [
        {"uid": f"{gid}/{i}", "group_id": gid, "index": i, "tokens": list(range(1, prompt + response + 1)),
         "response_length": response, "loss_mask": [1] * (response - 1) + [0],
         "rollout_logprobs": [-0.5] * response, "reward": reward + i, "weight_version": wv + i,
         "status": "completed", "prompt": "p", "label": {"answer": 3}}
        for i in range(n)]}


def lease(url: str, n: int, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/leases", json={"groups": n, **body}, timeout=60)


def stats(url: str) -> dict[str, int]:
    r = httpx.get(url + "/v1/stats", timeout=10)
    assert r.status_code == 200
    return r.json()
