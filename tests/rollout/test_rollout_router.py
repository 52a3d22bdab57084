"""The rollout service behind a real sglang-router process (from the SGLang venv), with reference
engines as its workers: workers registered with POST /workers, re-registered after a restart."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.procs import SGLANG_PYTHON, free_port
from tests.rollout.support import write_prompts


@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_router_routes_and_survives_an_engine_restart(tmp_path: Path, tiny_model, stacks) -> None:
    s = stacks(tiny_model, {
        "engines": {"backend": "reference", "count": 2, "base_port": free_port(), "python": str(SGLANG_PYTHON),
                    "health_interval_s": 0.5},
        "router": "sglang", "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 40))},
        "n_samples_per_prompt": 4, "mode": "on_demand", "sampling": {"max_new_tokens": 6}}).start()
    st = s.status()
    router = st["router"]
    workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(e["url"] for e in st["engines"])
    assert s.post("/v1/generate_batch", {"groups": 3}).json()["groups"] == 3
    os.kill(st["engines"][0]["pid"], signal.SIGKILL)
    s.wait(lambda st: st["engines"][0]["restarts"] == 1 and st["engines"][0]["healthy"], timeout=180,
           what="engine 0 restarted")
    workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(e["url"] for e in st["engines"])
    assert s.post("/v1/generate_batch", {"groups": 3}).json()["groups"] == 3
    assert len({g.group_id for g in s.lease_all()}) == 6
