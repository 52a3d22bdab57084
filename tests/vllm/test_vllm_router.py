"""sglang-router in front of a real vLLM 0.32 engine (``router: sglang`` with ``backend: vllm``).

The rollout service starts sglang-router from ``engines.python`` (for ``backend: vllm`` the vLLM
venv, which ``scripts/build_vllm_venv.sh`` gives sglang-router 0.3.2) and registers the engine's
SGLang-API adapter as its worker; every /generate of the service goes through the router. Groups
generated on demand must reach the buffer complete, with a logprob per response token.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.procs import VLLM_PYTHON, free_port, kill_groups
from tests.rollout.support import check_groups, write_prompts
from tests.vllm.support import N, STARTUP_TIMEOUT_S, TOKENS, VLLMStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_sglang_router_routes_to_a_vllm_engine(tmp_path: Path, tiny_model: Path) -> None:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    s = VLLMStack(tmp_path / "stack", tiny_model, {
        "engines": {"backend": "vllm", "count": 1, "python": str(VLLM_PYTHON), "base_port": free_port(),
                    "startup_timeout_s": STARTUP_TIMEOUT_S, "restart": False},
        "router": "sglang", "mode": "on_demand", "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 40))},
        "n_samples_per_prompt": N, "sampling": {"temperature": 1.0, "max_new_tokens": TOKENS, "ignore_eos": True}})
    pids: list[int] = []
    try:
        s.start()
        st = s.status()
        pids = [e["pid"] for e in st["engines"]]
        workers = httpx.get(f"{st['router']}/workers", timeout=10).json()["workers"]
        assert [w["url"] for w in workers] == [st["engines"][0]["url"]], workers
        out = s.post("/v1/generate_batch", {"groups": 3}, timeout=900).json()
        assert out["groups"] == 3, out
        groups = s.lease_all()
        assert len(groups) == 3
        check_groups(groups, vocab, N, TOKENS)
        st = s.status()
        assert st["sequences_sent"] >= 3 * N and st["engines"][0]["served"] == 0, st   # all through the router
        assert "sglang_router.launch_router" in s.rollout.log() and str(VLLM_PYTHON) in s.rollout.log()
    finally:
        s.stop()
        kill_groups(pids)   # safety net: the fleet stops its engines; never leave one running
