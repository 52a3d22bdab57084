"""The agent gateway on the real SGLang tier: one SGLang 0.5.23 server on CPU (the ``sglang`` venv)
behind the rollout service, driven by the official ``openai`` client: a two-turn chat with a tool
result is recorded token for token with SGLang's logprobs, and the finished episode's group reaches
the buffer. Needs .venv-sglang (``make sglang-venv``); ~1-3 min and ~2 GB of RAM here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import Proc, child_env, free_port, headrace_cmd
from tests.rollout.gateway_support import TokenStack, two_turn_tool_episode, write_tasks
from tests.sglang.sglang_cpu.server import CPU_ARGS, CPU_ENV, STARTUP_TIMEOUT_S, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


class SGLangTokenStack(TokenStack):
    def start_rollout(self) -> None:
        self.starts += 1
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port)), self.tmp / f"rollout-{self.starts}.log",
                            env=child_env(HEADRACE_LOG_LEVEL="INFO", HEADRACE_TOKEN=self.token, **CPU_ENV))
        self.rollout.wait_http(f"{self.url}/health", timeout=2 * STARTUP_TIMEOUT_S)


def test_gateway_on_sglang(tiny_model: Path, tmp_path: Path) -> None:
    st = SGLangTokenStack(tmp_path / "s", tiny_model, {
        "engines": {"backend": "sglang", "count": 1, "python": str(sglang_python()), "args": CPU_ARGS,
                    "base_port": free_port(), "startup_timeout_s": STARTUP_TIMEOUT_S, "restart": False},
        "mode": "on_demand", "data": {"path": str(write_tasks(tmp_path / "t.jsonl", 2))},
        "n_samples_per_prompt": 2, "groups_per_step": 2, "sampling": {"max_new_tokens": 6}}).start()
    try:
        two_turn_tool_episode(st, "sglang-1")
    finally:
        st.stop()
