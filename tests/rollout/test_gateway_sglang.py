"""The agent gateway on the real SGLang tier: one SGLang 0.5.23 server on CPU (the ``sglang`` venv)
behind the rollout service, driven by the official ``openai`` client: a two-turn chat with a tool
result is recorded token for token with SGLang's logprobs, and the finished episode's group reaches
the buffer. Needs .venv-sglang (``make sglang-venv``); ~1-3 min and ~2 GB of RAM here."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.procs import Proc, child_env, free_port, headrace_cmd
from tests.rollout.gateway_support import TOKEN, TokenStack, write_tasks
from tests.sglang.sglang_cpu.server import CPU_ARGS, CPU_ENV, STARTUP_TIMEOUT_S, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


class SGLangTokenStack(TokenStack):
    def start_rollout(self) -> None:
        self.starts += 1
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port)), self.tmp / f"rollout-{self.starts}.log",
                            env=child_env(HEADRACE_LOG_LEVEL="INFO", HEADRACE_TOKEN=TOKEN, **CPU_ENV))
        self.rollout.wait_http(f"{self.url}/health", timeout=2 * STARTUP_TIMEOUT_S)


def test_gateway_on_sglang(tiny_model: Path, tmp_path: Path) -> None:
    st = SGLangTokenStack(tmp_path / "s", tiny_model, {
        "engines": {"backend": "sglang", "count": 1, "python": str(sglang_python()), "args": CPU_ARGS,
                    "base_port": free_port(), "startup_timeout_s": STARTUP_TIMEOUT_S, "restart": False},
        "mode": "on_demand", "data": {"path": str(write_tasks(tmp_path / "t.jsonl", 2))},
        "n_samples_per_prompt": 2, "groups_per_step": 2, "sampling": {"max_new_tokens": 6}}).start()
    try:
        ep = st.open_episode(group_id="sglang-1")
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
        assert group.group_id == "sglang-1" and group.samples[0].tokens == seg["tokens"]
    finally:
        st.stop()
