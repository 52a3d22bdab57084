"""The rollout service driving real SGLang 0.5.23 servers behind a real sglang-router, on CPU.

``headrace rollout serve`` launches 2 SGLang engines from the SGLang venv
(``rollout.engines.backend: sglang``, ``engines.python`` = that venv's python) and sglang-router
(``rollout.router: sglang``, workers added with ``POST /workers``), and pushes groups into a real
``headrace buffer serve``. The groups must be valid (schema-checked by the buffer, n samples each,
logprobs per response token, version 0); concurrent sequences travel as batch /generate requests
through the router. Then one SGLang engine's process group is killed with
SIGKILL mid-run: the fleet must mark it down and generation must go on on the other engine.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Proc, child_env, free_port, headrace_cmd, kill_groups
from tests.rollout.support import Stack, check_groups, write_prompts
from tests.sglang.sglang_cpu.server import CPU_ARGS, CPU_ENV, STARTUP_TIMEOUT_S, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

N = 2          # samples per group
TOKENS = 12    # response tokens per sample (ignore_eos: every sample is truncated at TOKENS)


class SGLangStack(Stack):
    """A buffer and a rollout service whose engines are real SGLang servers (minutes to start here)."""

    def start_rollout(self) -> None:
        self.starts += 1
        env = child_env(HEADRACE_LOG_LEVEL="INFO", **CPU_ENV)
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port)), self.tmp / f"rollout-{self.starts}.log", env=env)
        self.rollout.wait_http(f"{self.url}/health", timeout=2 * STARTUP_TIMEOUT_S)


def rollout_config(prompts: Path) -> dict[str, Any]:
    return {
        "engines": {"backend": "sglang", "count": 2, "python": str(sglang_python()), "args": CPU_ARGS,
                    "base_port": free_port(), "startup_timeout_s": STARTUP_TIMEOUT_S,
                    "health_interval_s": 1.0, "health_failures": 3, "restart": False},
        "router": "sglang",
        "data": {"path": str(prompts)},
        "n_samples_per_prompt": N, "groups_per_step": 100, "max_concurrency": 8,
        "sampling": {"temperature": 1.0, "max_new_tokens": TOKENS, "ignore_eos": True},
    }


@pytest.mark.timeout(1800)
def test_two_sglang_engines_behind_sglang_router_fill_the_buffer_and_survive_a_kill(tmp_path: Path, tiny_model: Path) -> None:
    import json

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    s = SGLangStack(tmp_path / "stack", tiny_model, rollout_config(write_prompts(tmp_path / "p.jsonl", 400)))
    engine_pids: list[int] = []
    try:
        s.start()
        st = s.wait(lambda st: st["produced"] >= 4, timeout=600, what="4 groups from SGLang")
        engine_pids = [e["pid"] for e in st["engines"]]
        assert len(st["engines"]) == 2 and all(e["healthy"] for e in st["engines"]), st["engines"]
        assert s.get("/v1/engines") == [{"url": e["url"], "world_size": 1} for e in st["engines"]]
        check_groups(s.lease_all(), vocab, N, TOKENS, exact=True)
        # concurrent sequences went through the router as batch /generate requests, which it accepts
        assert st["generate_requests"] < st["sequences_sent"] and st["refused_batches"] == 0, st
        assert "--health-check-endpoint /get_model_info" in s.rollout.log()   # the router's checks too

        # a pause longer than health_failures x (interval + probe timeout): SGLang's /health fails
        # while paused, yet the engines are alive and must still be healthy (restart is off here:
        # an engine marked down would stay down)
        assert s.post("/v1/pause", {"mode": "abort"}).status_code == 200
        time.sleep(22.0)
        st = s.status()
        assert all(e["healthy"] for e in st["engines"]), st["engines"]
        assert "down" not in s.rollout.log()
        assert s.post("/v1/resume", {}).status_code == 200
        st = s.wait(lambda x: x["produced"] >= st["produced"] + 2, timeout=300, what="generation after a long pause")

        victim = st["engines"][0]
        os.killpg(victim["pid"], signal.SIGKILL)   # the engine's process group: launcher, scheduler, detokenizer
        produced_at_kill = s.status()["produced"]
        s.wait(lambda st: not st["engines"][0]["healthy"], timeout=120, what="the killed SGLang engine detected")
        st = s.wait(lambda st: st["produced"] >= produced_at_kill + 4, timeout=600,
                    what="generation continues on the other SGLang engine")
        assert st["engines"][1]["healthy"]
        assert "down" in s.rollout.log()
        check_groups(s.lease_all(), vocab, N, TOKENS, exact=True)
    finally:
        s.stop()
        kill_groups(engine_pids)   # safety net: the fleet stops its engines; never leave one running
