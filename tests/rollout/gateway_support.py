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
OWN = object()   # ``TokenStack.call``'s default: the stack's own token


class TokenStack(Stack):
    """``Stack`` with HEADRACE_TOKEN set for the buffer and the rollout service (and sent by ``call``)."""

    token = TOKEN   # a subclass may run the stack with another run token

    def start_buffer(self) -> None:
        self.buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(self.buffer_port), "--db",
                                        str(self.tmp / "buffer.sqlite")), self.tmp / "buffer.log",
                           env=child_env(HEADRACE_TOKEN=self.token))
        self.buffer.wait_http(f"{self.buffer_url}/health", timeout=60)

    def start_rollout(self) -> None:
        self.starts += 1
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port)), self.tmp / f"rollout-{self.starts}.log",
                            env=child_env(HEADRACE_LOG_LEVEL="INFO", HEADRACE_TOKEN=self.token))
        self.rollout.wait_http(f"{self.url}/health", timeout=240)

    def call(self, method: str, path: str, body: Any = None, token: str | None | object = OWN,
             timeout: float = 300) -> httpx.Response:
        """``token``: the stack's own by default; None sends no Authorization header."""
        if token is OWN:
            token = self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, f"{self.url}{path}", json=body, headers=headers, timeout=timeout)

    def get(self, path: str, timeout: float = 300) -> Any:
        r = self.call("GET", path, timeout=timeout)
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
        return self.lease_all(self.token)

    def buffer_stats(self) -> dict[str, Any]:
        with BufferClient(self.buffer_url, token=self.token) as c:
            return c.stats().model_dump()


def two_turn_tool_episode(st: TokenStack, group_id: str) -> None:
    """An external episode driven by the official ``openai`` client on ``st``'s engines: a chat call,
    a tool result, a second call; the episode is one segment holding both completions token for
    token with the engine's logprobs (loss_mask 0 exactly on the tool turn and template tokens), and
    the finished episode's group reaches the buffer with those tokens. The engine-tier tests share it."""
    import time

    import openai
    import pytest

    ep = st.open_episode(group_id=group_id)
    c = openai.OpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0)
    msgs: list = [{"role": "user", "content": "What is 2 + 3?"}]
    r1 = c.chat.completions.create(model="tiny-qwen2", messages=msgs, max_tokens=6, logprobs=True)
    msgs += [r1.choices[0].message, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r2 = c.chat.completions.create(model="tiny-qwen2", messages=msgs, max_tokens=6, logprobs=True)
    (seg,) = st.get(f"/v1/episodes/{ep['episode_id']}")["segments"]
    n1, n2 = r1.usage.completion_tokens, r2.usage.completion_tokens
    assert r2.usage.prompt_tokens == len(seg["tokens"]) - n2 and len(seg["tokens"]) - seg["prompt_length"] > n1 + n2
    ctx = r2.usage.prompt_tokens - seg["prompt_length"] - n1
    assert seg["loss_mask"] == [1] * n1 + [0] * ctx + [1] * n2
    lps = [x.logprob for x in r1.choices[0].logprobs.content] + [x.logprob for x in r2.choices[0].logprobs.content]
    assert [lp for lp, m in zip(seg["rollout_logprobs"], seg["loss_mask"]) if m] == pytest.approx(lps)
    st.finish(ep["episode_id"], reward=1.0)
    deadline = time.monotonic() + 60
    while st.buffer_stats()["queued"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    (group,) = st.buffer_groups()
    assert group.group_id == group_id and group.samples[0].tokens == seg["tokens"]


def write_tasks(path: Path, n: int) -> Path:
    """Calculator tasks: ``{"prompt": "What is a + b?", "label": "<sum>"}``."""
    import json

    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i + 2}?", "label": str(2 * i + 2)}) + "\n"
                            for i in range(n)))
    return path
