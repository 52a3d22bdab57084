"""Faults on loopback with real processes: an engine killed mid-run, the rollout service killed
(-9) and restarted (data cursor), and a buffer outage. No group is lost or duplicated."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port
from tests.rollout.support import write_prompts


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finished_on_disk(state_path: Path) -> int:
    """Prompts the rollout's cursor file records as finished (it is replaced atomically)."""
    try:
        st = json.loads(state_path.read_text())
    except FileNotFoundError:
        return 0
    return int(st["watermark"]) + len(st.get("done", []))


def _positions(groups) -> list[int]:
    return sorted(g.metadata["position"] for g in groups)


@pytest.mark.slow
def test_engine_killed_mid_run_is_rerouted_and_restarted(tmp_path: Path, tiny_model, stacks) -> None:
    s = stacks(tiny_model, {
        "engines": {"backend": "reference", "count": 2, "base_port": free_port(), "health_interval_s": 0.5},
        # enough prompts and admission room (2 x groups_per_step) that engine 1 alone cannot finish
        # them all while engine 0 restarts (200 prompts once were, and nothing was left for it)
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 2000))},
        "n_samples_per_prompt": 2, "groups_per_step": 1000, "max_concurrency": 8,
        "sampling": {"max_new_tokens": 24, "ignore_eos": True}}).start()
    st = s.wait(lambda st: st["produced"] >= 2 and st["engines"][0]["in_flight"] > 0, what="engine 0 busy")
    victim = st["engines"][0]
    _kill(victim["pid"])
    produced_at_kill = st["produced"]
    st = s.wait(lambda st: st["engines"][0]["restarts"] == 1, timeout=60, what="engine 0 detected and restarted")
    assert st["engines"][1]["healthy"]
    st = s.wait(lambda st: st["engines"][0]["healthy"] and st["engines"][0]["pid"] != victim["pid"],
                timeout=120, what="engine 0 healthy again")
    served_before = st["engines"][0]["served"]
    st = s.wait(lambda st: st["produced"] >= produced_at_kill + 6 and st["engines"][0]["served"] > served_before,
                timeout=180, what="generation continues on both engines")
    assert st["counts"]["samples_failed"] == 0  # the killed engine's requests were rerouted, not failed
    assert "down" in s.rollout.log()
    groups = s.lease_all()
    assert len({g.group_id for g in groups}) == len(groups) >= produced_at_kill + 6
    assert all(x.response_length == 24 and x.status == "truncated" for g in groups for x in g.samples)


@pytest.mark.slow
def test_a_paused_engine_is_alive_not_down(tmp_path: Path, tiny_model, stacks) -> None:
    # SGLang's /health runs a generation: while paused it blocks and answers 503 (the reference
    # engine answers 503 too). A long pause (a big model's training phase) must not get every
    # engine marked down and restarted: the fleet probes liveness (/get_model_info) meanwhile.
    s = stacks(tiny_model, {
        "engines": {"backend": "reference", "count": 1, "base_port": free_port(), "health_interval_s": 0.2,
                    "health_failures": 2},
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 200))},
        "n_samples_per_prompt": 2, "groups_per_step": 100, "max_concurrency": 4,
        "sampling": {"max_new_tokens": 8, "ignore_eos": True}}).start()
    st = s.wait(lambda st: st["produced"] >= 2, what="groups produced")
    assert s.post("/v1/pause", {"mode": "abort"}).status_code == 200
    url = st["engines"][0]["url"]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 503      # what a naive probe would see
    time.sleep(3.0)                                                          # 15 probe intervals
    st = s.status()
    assert st["engines"][0]["restarts"] == 0 and st["engines"][0]["healthy"], st["engines"]
    assert "down" not in s.rollout.log()
    produced = st["produced"]
    assert s.post("/v1/resume", {}).status_code == 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    s.wait(lambda st: st["produced"] >= produced + 2, what="generation after resume")
    _kill(st["engines"][0]["pid"])                                           # a dead one is still found
    s.wait(lambda st: st["engines"][0]["restarts"] == 1, timeout=60, what="engine restarted")


@pytest.mark.slow
def test_rollout_killed_and_restarted_resumes_the_data_cursor(tmp_path: Path, tiny_model, stacks) -> None:
    n = 14
    s = stacks(tiny_model, {
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", n)), "epochs": 1, "seed": 11},
        "n_samples_per_prompt": 2, "groups_per_step": 100, "max_concurrency": 4,
        "sampling": {"max_new_tokens": 256, "ignore_eos": True}}).start()
    # the cursor file is rewritten every 0.2 s (deferred saves): wait until it records 4 finished
    # prompts while others are still in flight, then kill. 256 tokens a sample keep that window
    # open for seconds: with 16 the 14 prompts were done before a poll saw it (a CI run, 5 Dec)
    st = s.wait(lambda st: _finished_on_disk(s.tmp / "rollout_state.json") >= 4 and st["groups_in_flight"] > 0,
                what="4 finished prompts in the cursor file, more in flight")
    saved = _finished_on_disk(s.tmp / "rollout_state.json")
    engine_pids = [e["pid"] for e in st["engines"]]
    s.rollout.kill9()  # no cleanup: in-flight groups are lost with the process
    for pid in engine_pids:  # its engines were in their own sessions: end them by pid
        _kill(pid)
    s.start_rollout()
    st = s.status()
    assert st["data"]["watermark"] + st["data"]["done_ahead"] >= saved  # resumed from the cursor, not from 0
    s.wait(lambda st: st["data"]["watermark"] == n, timeout=240, what="the epoch finished")
    groups = s.lease_all()
    assert _positions(groups) == list(range(n))  # every prompt exactly once: none skipped, none repeated
    assert len({g.group_id for g in groups}) == n


@pytest.mark.slow
def test_buffer_outage_loses_and_duplicates_nothing(tmp_path: Path, tiny_model, stacks) -> None:
    n = 12
    s = stacks(tiny_model, {
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", n)), "epochs": 1},
        # slow enough (2 sequences at a time, 64 tokens each) that groups are still finishing while the
        # buffer is down, even on an idle machine
        "n_samples_per_prompt": 2, "groups_per_step": 100, "max_concurrency": 2, "push_retry_max_s": 0.5,
        "sampling": {"max_new_tokens": 64, "ignore_eos": True}}).start()
    s.wait(lambda st: st["produced"] >= 2, what="first pushes")
    s.buffer.kill9()
    st = s.wait(lambda st: not st["push"]["buffer_up"] and st["push"]["pending"] > 0, timeout=120,
                what="pushes held while the buffer is down")
    time.sleep(1.0)
    assert s.rollout.alive()
    s.start_buffer()  # same port, same database
    st = s.wait(lambda st: st["data"]["watermark"] == n and st["push"]["pending"] == 0, timeout=240,
                what="everything pushed after recovery")
    assert st["push"]["buffer_up"] and st["push"]["retries"] > 0
    groups = s.lease_all()
    assert _positions(groups) == list(range(n)) and len({g.group_id for g in groups}) == n
    stats = s.buffer_stats()
    assert stats["queued"] == 0 and stats["consumed"] == n


GARBAGE_ENGINE = """
import sys, uvicorn
from fastapi import FastAPI
app = FastAPI()
@app.get("/health")
async def health():
    return {}
@app.post("/generate")
async def generate():
    return {"output_ids": "not a list", "meta_info": {"finish_reason": "maybe"}}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_engine_answering_garbage_fails_samples_and_the_service_keeps_running(tmp_path: Path, tiny_model,
                                                                            stacks) -> None:
    """A stand-in server that answers malformed /generate bodies: the only way to get garbage from an engine."""
    import sys

    from tests.procs import Proc, child_env

    (tmp_path / "garbage.py").write_text(GARBAGE_ENGINE)
    port = free_port()
    garbage = Proc([sys.executable, str(tmp_path / "garbage.py"), str(port)], tmp_path / "garbage.log", env=child_env())
    try:
        garbage.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        prompts = write_prompts(tmp_path / "p.jsonl", 3, lambda i: str(i))
        with open(prompts, "a") as f:
            f.write('{"prompt": "' + "1+" * 100 + '1=", "label": "101"}\n')
        s = stacks(tiny_model, {
            "engines": {"backend": "external", "urls": [f"http://127.0.0.1:{port}"]},
            "data": {"path": str(prompts), "epochs": 1,
                     "shuffle": False, "prompt_template": "{prompt}"},
            "max_prompt_length": 64, "n_samples_per_prompt": 2, "mode": "on_demand"}).start()
        r = s.post("/v1/generate_batch", {"groups": 4}).json()
        assert (r["groups"], r["data_exhausted"]) == (0, True)
        st = s.status()
        assert st["counts"]["groups_failed"] == 4 and st["counts"]["samples_failed"] == 8
        assert "unusable body" in s.rollout.log()
        assert "> rollout.max_prompt_length 64" in s.rollout.log()  # the long prompt failed before any engine call
        assert s.get("/health")["status"] == "ok"
    finally:
        garbage.stop()


@pytest.mark.slow
def test_restarted_service_finds_its_predecessors_pause_and_waits_for_resume(tmp_path: Path, tiny_model,
                                                                           stacks) -> None:
    """A rollout service killed between a trainer's pause and its resume leaves the (external)
    engines paused: /health answers 503. Its successor must come up anyway, paused, so the trainer's
    retried /v1/resume reaches it (it used to wait for /health until the trainer gave up)."""
    from tests.procs import reference_engine

    with reference_engine(tiny_model, tmp_path / "engine.log") as (url, _engine):
        s = stacks(tiny_model, {
            "engines": {"backend": "external", "urls": [url]},
            "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 200))},
            "n_samples_per_prompt": 2, "groups_per_step": 100, "max_concurrency": 2,
            "sampling": {"max_new_tokens": 8, "ignore_eos": True}}).start()
        s.wait(lambda st: st["produced"] >= 2, what="groups produced")
        assert s.post("/v1/pause", {"mode": "abort"}).status_code == 200
        s.rollout.kill9()
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        s.start_rollout()
        st = s.status()
        assert st["paused"] and st["engines"][0]["healthy"], st
        assert "taken as paused by a previous rollout service" in s.rollout.log()
        produced = st["produced"]
        assert s.post("/v1/resume", {}).status_code == 200
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        s.wait(lambda st: st["produced"] >= produced + 2, what="generation after resume")
