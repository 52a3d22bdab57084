"""The run token with real SGLang 0.5.23 engines behind a real sglang-router, on CPU.

``headrace rollout serve`` with ``HEADRACE_TOKEN`` launches one SGLang engine and sglang-router
(``--api-key`` added inside each child's own argv from its environment, ``shared.auth.module_argv``)
and pushes groups into a buffer that requires the token. Checked: groups arrive (the fleet, the
router and the pusher all send the token), the engine and the router answer 401 without it, and no
process of the stack holds the token on its command line, nor any log file in its output.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from headrace.deploy.supervisor import descendants
from tests.procs import Proc, child_env, headrace_cmd
from tests.rollout.support import Stack, write_prompts
from tests.sglang.sglang_cpu.server import CPU_ARGS, CPU_ENV, STARTUP_TIMEOUT_S, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TOKEN = "tok-sgl-7c1e"
RIGHT = {"authorization": f"Bearer {TOKEN}"}


class TokenStack(Stack):
    """Buffer and rollout service started with the run token in their environment."""

    def start_buffer(self) -> None:
        self.buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(self.buffer_port), "--memory"),
                           self.tmp / "buffer.log", env=child_env(HEADRACE_TOKEN=TOKEN))
        self.buffer.wait_http(f"{self.buffer_url}/health", timeout=60)

    def start_rollout(self) -> None:
        self.starts += 1
        env = child_env(HEADRACE_LOG_LEVEL="INFO", HEADRACE_TOKEN=TOKEN, **CPU_ENV)
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port)), self.tmp / f"rollout-{self.starts}.log", env=env)
        self.rollout.wait_http(f"{self.url}/health", timeout=2 * STARTUP_TIMEOUT_S)

    def status(self, timeout: float = 30) -> dict:
        return httpx.get(f"{self.url}/v1/status", headers=RIGHT, timeout=timeout).json()


@pytest.mark.timeout(1800)
def test_sglang_engine_and_router_require_the_run_token(tmp_path: Path, tiny_model: Path) -> None:
    s = TokenStack(tmp_path / "stack", tiny_model, {
        "engines": {"backend": "sglang", "count": 1, "python": str(sglang_python()), "args": CPU_ARGS,
                    "startup_timeout_s": STARTUP_TIMEOUT_S, "restart": False},
        "router": "sglang", "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 50))},
        "n_samples_per_prompt": 2, "groups_per_step": 2, "max_concurrency": 4,
        "sampling": {"max_new_tokens": 4, "ignore_eos": True}})
    try:
        s.start()
        s.wait(lambda st: st["produced"] >= 2, timeout=600, what="groups through the router")
        st = s.status()
        engine, router = st["engines"][0]["url"], st["router"]
        assert httpx.get(f"{engine}/get_model_info", timeout=30).status_code == 401
        assert httpx.get(f"{engine}/get_model_info", headers=RIGHT, timeout=30).status_code == 200
        assert httpx.get(f"{router}/workers", timeout=30).status_code == 401
        assert httpx.get(f"{router}/workers", headers=RIGHT, timeout=30).status_code == 200
        pids = [s.buffer.pid, s.rollout.pid] + [pid for pid, _ in descendants(s.rollout.pid)]
        assert len(pids) >= 4          # buffer, rollout, the engine (and its workers), the router
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert TOKEN.encode() not in cmdline, cmdline[:300]
        assert httpx.get(f"{s.buffer_url}/v1/stats", headers=RIGHT, timeout=30).json()["queued"] >= 2
        logs = list((s.tmp / "run" / "logs").glob("*.log"))
        assert {p.name for p in logs} >= {"engine-0.log", "sglang-router.log"}
        for log in logs:        # SGLang logs its arguments, --api-key included: masked on the way out
            assert TOKEN not in log.read_text(errors="replace"), log
    finally:
        s.stop()
