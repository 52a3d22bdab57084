"""Several rollout services on one buffer (DESIGN.md "Columnar wire format and scale-out"), as real
processes on loopback:

    headrace buffer serve  --port PB --db DB
    headrace rollout serve --config C0 --port R0     (rollout.data.shard {index: 0, count: 2}, one reference engine)
    headrace rollout serve --config C1 --port R1     (rollout.data.shard {index: 1, count: 2}, one reference engine)
    headrace train --config C0 --buffer-url http://HOST:PB --rollout-url http://HOST:R0 --rollout-url http://HOST:R1

Both services share one config but for the shard (same prompts, seed, state_path: each keeps its
own cursor file). Checked: the run finishes all steps; no prompt is drawn twice (every stored
group is a distinct slot of the first epoch, the buffer counted no duplicate, both services' groups
were stored, the two cursors hold disjoint slots of their own shard); throughout the run no
service generates under a version that any engine of either service lacks (read the services'
versions, then the engines': every engine >= every service, so a sync never resumes one service
before the other's engines have the version); at the end every engine and service is at the last
version. Cost: ~1.5-3 min on the 2-core machine (five processes, tiny model).
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import Proc, child_env, free_port, headrace_cmd
from tests.rollout.support import write_prompts

STEPS = 4
GROUPS = 2
PROMPTS = 64


def _steps_done(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max([r["step"] for r in rows if r.get("loss") is not None], default=0)


def _versions(services: list[str]) -> tuple[list[int], list[int]]:
    """The services' weight versions, then (read after them) every engine's."""
    statuses = [httpx.get(f"{u}/v1/status", timeout=30).json() for u in services]
    engine_urls = [e["url"] for st in statuses for e in st["engines"]]
    engines = [httpx.get(f"{e}/get_weight_version", timeout=30).json()["weight_version"] for e in engine_urls]
    # an engine serves its initial weights as SGLang's "default" version: the policy's version 0
    return [int(st["weight_version"]) for st in statuses], [0 if v == "default" else int(v) for v in engines]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_sharded_rollout_services_feed_one_buffer_and_one_trainer(tmp_path: Path, tiny_model: Path) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS, label=lambda i: str(i + 1))
    pb = free_port()
    buffer_url = f"http://127.0.0.1:{pb}"
    rollout_ports = [free_port(), free_port()]
    services = [f"http://127.0.0.1:{p}" for p in rollout_ports]
    state = tmp_path / "rollout_state.json"
    out = tmp_path / "run"
    configs = []
    for index in (0, 1):
        config = tmp_path / f"run{index}.yaml"
        config.write_text(yaml.safe_dump({
            "model": str(tiny_model),
            "buffer": {"url": buffer_url},
            "rollout": {"engines": {"backend": "reference", "count": 1, "base_port": free_port()},
                        "data": {"path": str(prompts), "shard": {"index": index, "count": 2}},
                        "n_samples_per_prompt": 2, "groups_per_step": GROUPS, "max_concurrency": 4,
                        "sampling": {"temperature": 1.0, "max_new_tokens": 4}, "reward": "exact_match",
                        "state_path": str(state)},
            "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 5, "micro_batch_tokens": 256},
            "run": {"placement": "disaggregated", "out": str(out), "eval_every": 0},
        }))
        configs.append(config)
    logs = tmp_path / "logs"
    db = tmp_path / "buffer.sqlite"
    procs: list[Proc] = []
    try:
        buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(pb), "--db", str(db)), logs / "buffer.log")
        procs.append(buffer)
        buffer.wait_http(f"{buffer_url}/health", 60)
        rollouts = [Proc(headrace_cmd("rollout", "serve", "--config", str(c), "--port", str(p)), logs / f"rollout{i}.log",
                         env=child_env(HEADRACE_LOG_LEVEL="INFO"))
                    for i, (c, p) in enumerate(zip(configs, rollout_ports))]
        procs += rollouts
        for r, url in zip(rollouts, services):
            r.wait_http(f"{url}/health", 240)
        # what the trainer checks at its start: the same prompts (fingerprint), disjoint shards
        datas = [httpx.get(f"{u}/v1/status", timeout=30).json()["data"] for u in services]
        assert datas[0]["fingerprint"] == datas[1]["fingerprint"], datas
        assert [d["shard"] for d in datas] == [{"index": 0, "count": 2}, {"index": 1, "count": 2}]
        trainer = Proc(headrace_cmd("train", "--config", str(configs[0]), "--buffer-url", buffer_url,
                                    "--rollout-url", services[0], "--rollout-url", services[1]), logs / "trainer.log")
        procs.append(trainer)

        snapshots = 0
        deadline = time.monotonic() + 600
        while trainer.alive():
            assert time.monotonic() < deadline, trainer.log()[-4000:]
            for r in rollouts:
                assert r.alive(), r.log()[-4000:]
            served, engines = _versions(services)
            assert min(engines) >= max(served), (served, engines, "a service resumed before every engine synced")
            snapshots += 1
            time.sleep(0.3)
        assert trainer.popen.returncode == 0, trainer.log()[-6000:]
        assert _steps_done(out / "metrics.jsonl") == STEPS
        assert "weight-sync group joined by 2 engine(s) of 2 rollout service(s)" in trainer.log()
        assert not any(w in trainer.log() for w in ("are drawn by none", "admission shares sum", "could not check"))
        served, engines = _versions(services)
        assert served == [STEPS, STEPS] and engines == [STEPS, STEPS], (served, engines)
        assert snapshots > 0
        saved = yaml.safe_load((out / "trainer_config.yaml").read_text())["rollout"]
        assert (saved["url"], saved["extra_urls"]) == (services[0], [services[1]])
        stats = httpx.get(f"{buffer_url}/v1/stats", timeout=10).json()
        assert stats["consumed"] == STEPS * GROUPS and stats["duplicates"] == 0, stats
        for r in rollouts:
            r.stop()                      # graceful: flushes the cursors
        buffer.stop()
    finally:
        for p in reversed(procs):
            p.stop()

    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT group_id, state FROM groups").fetchall()
    slots = [tuple(map(int, re.search(r"-e(\d+)-g(\d+)$", g).groups())) for g, _ in rows]
    assert len(slots) == len(set(slots)) and all(e == 0 for e, _ in slots), slots   # one epoch: distinct prompts
    # which service's groups the trainer leased is the buffer's FIFO under the machine's timing (one
    # service may produce every leased group under load); that both produced is the run's guarantee
    producers = {int(re.search(r"-g(\d+)$", g).group(1)) % 2 for g, _ in rows}
    assert producers == {0, 1}, "the buffer stored groups of both services"
    finished = []
    for index in (0, 1):
        cursor = json.loads((tmp_path / f"rollout_state.shard{index}of2.json").read_text())
        assert cursor["shard"] == [index, 2]
        mine = {g for g in range(cursor["watermark"]) if g % PROMPTS % 2 == index} | set(cursor["done"])
        assert mine and all(g % PROMPTS % 2 == index for g in mine), (index, cursor)
        finished.append(mine)
    assert not finished[0] & finished[1]
    assert not state.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("weights, shares, split", [(None, [4, 4], True), ([3, 1], [6, 2], True), (None, [4, 4], False)],
                         ids=["even", "weighted", "different-data"])
def test_two_continuous_services_without_a_trainer_stay_below_twice_the_cap(
        tmp_path: Path, tiny_model: Path, weights: list[int] | None, shares: list[int], split: bool) -> None:
    """No trainer consumes: each service generates ahead until the admission rule stops it. With
    the cap counted per service (as one service alone does) two of them filled the buffer to twice
    the cap; with their shares of it (``shared.staleness.admits``: even, or by ``shard.weights``)
    they stop below that. ``different-data``: two prompt files, ``split: false`` and one
    ``rollout.run_id``: each draws its own prompts, takes its share of the cap, and no group id is
    shared (the buffer counts no duplicate)."""
    cap = 2 * GROUPS * 2          # (max_staleness 1 + 1) x groups_per_step (GROUPS * 2)
    assert sum(shares) == cap
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS, label=lambda i: str(i + 1))
    data = [prompts, prompts if split else write_prompts(tmp_path / "other.jsonl", PROMPTS + 3, label=str)]
    pb = free_port()
    buffer_url = f"http://127.0.0.1:{pb}"
    ports = [free_port(), free_port()]
    procs: list[Proc] = []
    try:
        buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(pb), "--db", str(tmp_path / "buffer.sqlite"),
                                   "--max-staleness", "1"), tmp_path / "buffer.log")
        procs.append(buffer)
        buffer.wait_http(f"{buffer_url}/health", 60)
        for index, port in enumerate(ports):
            config = tmp_path / f"run{index}.yaml"
            config.write_text(yaml.safe_dump({
                "model": str(tiny_model), "buffer": {"url": buffer_url, "max_staleness": 1},
                "rollout": {"engines": {"backend": "reference", "count": 1, "base_port": free_port()},
                            "data": {"path": str(data[index]),
                                     "shard": {"index": index, "count": 2, "weights": weights, "split": split}},
                            "n_samples_per_prompt": 2, "groups_per_step": GROUPS * 2, "mode": "continuous",
                            "sampling": {"temperature": 1.0, "max_new_tokens": 4}, "reward": "exact_match",
                            "state_path": str(tmp_path / "rollout_state.json"), "stats_interval_s": 0.1,
                            **({} if split else {"run_id": "one-run"})},
                "run": {"out": str(tmp_path / "run")}}))
            procs.append(Proc(headrace_cmd("rollout", "serve", "--config", str(config), "--port", str(port)),
                              tmp_path / f"rollout{index}.log"))
        services = [f"http://127.0.0.1:{p}" for p in ports]
        for p, url in zip(procs[1:], services):
            p.wait_http(f"{url}/health", 240)
        last, still, deadline = -1, 0, time.monotonic() + 300
        while still < 10:                 # settled: nothing in flight, the buffer unchanged for ~2 s
            assert time.monotonic() < deadline, [p.log()[-2000:] for p in procs]
            statuses = [httpx.get(f"{u}/v1/status", timeout=30).json() for u in services]
            queued = httpx.get(f"{buffer_url}/v1/stats", timeout=30).json()["queued"]
            idle = all(st["groups_in_flight"] == 0 for st in statuses)
            still = still + 1 if idle and queued == last else 0
            last = queued
            time.sleep(0.2)
        assert [(st["admission_cap"], st["admission_share"]) for st in statuses] == [(cap, x) for x in shares]
        assert all(st["produced"] > 0 for st in statuses), statuses
        assert cap <= queued < 2 * cap, (queued, [st["produced"] for st in statuses])
        assert httpx.get(f"{buffer_url}/v1/stats", timeout=30).json()["duplicates"] == 0
        assert len({st["data"]["fingerprint"] for st in statuses}) == (1 if split else 2)
        assert [st["data"]["shard"].get("split", True) for st in statuses] == [split, split]
    finally:
        for p in reversed(procs):
            p.stop()
