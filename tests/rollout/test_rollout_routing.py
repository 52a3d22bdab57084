"""Routing of a group's samples (rollout/generate.py ``EngineClient._once``), on loopback: a real
rollout service (backend external) over two simulated engines (bench/fleet_sim.py's, which answer
``/generate`` at once), counted by the service's own per-engine ``served`` figures.

- A group's samples share one engine: its batches hold whole groups (one prompt, prefilled and
  cached once) and the group is complete when that engine answers.
- The sharing is bounded: once the group's engine has a whole batch (``coalesce_max``) more in
  flight than the least busy one, the rest of the group goes elsewhere, so a big group still uses
  the fleet.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.procs import REPO, Proc, child_env
from tests.rollout.support import Stack, write_prompts


def _sim_engines(tmp_path: Path, count: int) -> tuple[list[str], Proc]:
    ports_file = tmp_path / "ports.json"
    proc = Proc([sys.executable, str(REPO / "bench" / "fleet_sim.py"), "--serve-engines", str(count),
                 "--ports-file", str(ports_file)], tmp_path / "sim.log", env=child_env())
    deadline = time.monotonic() + 60
    while not ports_file.exists():
        assert proc.alive() and time.monotonic() < deadline, proc.log()[-2000:]
        time.sleep(0.05)
    return [f"http://127.0.0.1:{p}" for p in json.loads(ports_file.read_text())], proc


def _served(s: Stack) -> list[int]:
    return [e["served"] for e in s.status()["engines"]]


@pytest.mark.parametrize("n, coalesce_max", [(8, 32), (8, 4)])
def test_a_groups_samples_share_one_engine_until_it_is_a_batch_busier(
        tmp_path: Path, tiny_model: Path, stacks: Callable[..., Stack], n: int, coalesce_max: int) -> None:
    urls, sim = _sim_engines(tmp_path, 2)
    try:
        cfg: dict[str, Any] = {
            "engines": {"backend": "external", "urls": urls, "coalesce_max": coalesce_max},
            "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 40)), "shuffle": False},
            "n_samples_per_prompt": n, "mode": "on_demand", "max_concurrency": 4 * n,
            "sampling": {"max_new_tokens": 3, "ignore_eos": True}}
        s = stacks(tiny_model, cfg).start()
        before = _served(s)
        for groups in (1, 1, 4):
            assert s.post("/v1/generate_batch", {"groups": groups}).json()["groups"] == groups
            after = _served(s)
            got = [a - b for a, b in zip(after, before)]
            before = after
            assert sum(got) == groups * n, got
            if coalesce_max >= n:    # each group on one engine: every engine served whole groups
                assert all(k % n == 0 for k in got), got
                if groups == 1:
                    assert sorted(got) == [0, n], got
            else:                    # a group larger than a batch: spread, neither engine idle
                assert all(k > 0 for k in got), got
        groups = s.lease_all()
        assert len(groups) == 6 and all(len(g.samples) == n for g in groups)
    finally:
        sim.stop()
