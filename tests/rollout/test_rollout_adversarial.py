"""The rollout service attacked: real buffer, rollout service and reference engine processes on
loopback. Bad control-API input is a 4xx naming the problem, the service keeps serving and nothing
changed (no group produced, data cursor and weight version as before). Stopping: SIGTERM while a
large generate_batch runs ends the service and its engines; after SIGKILL of the service its
engines stop by themselves and a restarted service comes up on the same engine ports.

Bad-input classes here: generate_batch groups beyond the admission cap (10^6), groups of the wrong
type (string, bool, fraction), groups < 1, unknown fields, resume weight_version of the wrong type
(string, bool, fraction, list), negative, beyond 2^63 - 1, pause with an unknown mode, memory tags
outside the known set, a body that is not JSON, a body that is not an object, an oversized body.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from tests.procs import Proc, child_env
from tests.rollout.support import Stack, write_prompts

GROUPS_PER_STEP, MAX_STALENESS = 2, 1          # admission cap (1 + 1) x 2 = 4


def on_demand(stacks: Callable[..., Stack], model: Path, tmp: Path, max_new_tokens: int = 4) -> Stack:
    return stacks(model, {"data": {"path": str(write_prompts(tmp / "p.jsonl", 64)), "shuffle": False},
                          "n_samples_per_prompt": 2, "mode": "on_demand", "groups_per_step": GROUPS_PER_STEP,
                          "sampling": {"max_new_tokens": max_new_tokens, "ignore_eos": True}},
                  max_staleness=MAX_STALENESS)


def snapshot(s: Stack) -> tuple[Any, ...]:
    st = s.status()
    return st["produced"], st["data"], st["weight_version"], st["paused"]


def detail(r: httpx.Response) -> str:
    return str(r.json()["detail"])


BAD = [
    ("/v1/generate_batch", {"groups": 10 ** 6}, "admission cap 4"),
    ("/v1/generate_batch", {"groups": 5}, "admission cap 4"),
    ("/v1/generate_batch", {"groups": "2"}, "groups"),
    ("/v1/generate_batch", {"groups": True}, "groups"),
    ("/v1/generate_batch", {"groups": 2.0}, "groups"),
    ("/v1/generate_batch", {"groups": 0}, "groups"),
    ("/v1/generate_batch", {"groups": 2, "weight_version": "9"}, "weight_version"),
    ("/v1/generate_batch", {"groups": 2, "drain_cursor": True}, "drain_cursor"),
    ("/v1/generate_batch", {}, "groups"),
    ("/v1/resume", {"weight_version": "7"}, "weight_version"),
    ("/v1/resume", {"weight_version": True}, "weight_version"),
    ("/v1/resume", {"weight_version": 3.0}, "weight_version"),
    ("/v1/resume", {"weight_version": -1}, "weight_version"),
    ("/v1/resume", {"weight_version": 2 ** 63}, "weight_version"),
    ("/v1/resume", {"weight_version": [1]}, "weight_version"),
    ("/v1/pause", {"mode": "sideways"}, "mode"),
    ("/v1/pause", {"timeout_s": "5"}, "timeout_s"),
    ("/v1/release_memory", {"tags": ["gpu"]}, "tags"),
    ("/v1/evaluate", {"n": "all"}, "n"),
    ("/v1/evaluate", {"part": [2, 2]}, "part"),
    ("/v1/evaluate", {"part": [0, 0]}, "part"),
    ("/v1/evaluate", {"part": [1]}, "part"),
    ("/v1/evaluate", {"part": ["0", 2]}, "part"),
]


def test_bad_control_input_is_a_4xx_naming_it_and_changes_nothing(stacks: Callable[..., Stack], tiny_model: Path,
                                                                  tmp_path: Path) -> None:
    s = on_demand(stacks, tiny_model, tmp_path).start()
    before = snapshot(s)
    for path, body, needle in BAD:
        r = s.post(path, body, timeout=60)
        assert r.status_code == 422, (path, body, r.status_code, r.text)
        assert needle in detail(r), (path, body, r.text)
        assert snapshot(s) == before, (path, body)
    for path in ("/v1/resume", "/v1/generate_batch"):   # (generate_batch: a plain route, FastAPI's 422 shape)
        for raw in (b"{not json", b"[1, 2]", b'"x"', b""):
            r = httpx.post(f"{s.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "body", (path, raw, r.text)
    r = s.post("/v1/generate_batch", {"groups": 0}, timeout=30)
    assert r.json()["detail"][0]["loc"] == ["body", "groups"] and "greater than or equal to 1" in r.text
    big = b'{"groups": 1, "pad": "' + b"x" * (3 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{s.url}/v1/generate_batch", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "rollout.max_body_mb" in detail(r), r.text
    assert snapshot(s) == before
    assert s.buffer_stats()["queued"] == 0
    r = s.post("/v1/generate_batch", {"groups": 2})                 # still serving, and within the cap it works
    assert r.status_code == 200 and r.json()["groups"] == 2, r.text
    assert s.post("/v1/resume", {"weight_version": 0}).json()["weight_version"] == 0


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_exists(p) for p in pids):
        time.sleep(0.2)
    return not any(_exists(p) for p in pids)


def _background(fn: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            fn()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_stops_a_service_busy_with_a_large_batch_and_its_engines(stacks: Callable[..., Stack],
                                                                         tiny_model: Path, tmp_path: Path) -> None:
    s = on_demand(stacks, tiny_model, tmp_path, max_new_tokens=1500).start()
    engines = [e["pid"] for e in s.status()["engines"]]
    _background(lambda: s.post("/v1/generate_batch", {"groups": 4}, timeout=900))
    s.wait(lambda st: st["in_flight"] > 0, timeout=60, what="generation in flight")
    assert s.rollout is not None
    os.kill(s.rollout.pid, signal.SIGTERM)
    try:
        s.rollout.popen.wait(15)
    except Exception:  # noqa: BLE001
        raise AssertionError(f"still running 15 s after SIGTERM:\n{s.rollout.log()[-3000:]}") from None
    assert _gone(engines, 15), "the service's engines outlived it"


def test_after_sigkill_its_engines_stop_and_a_restart_takes_the_same_ports(stacks: Callable[..., Stack],
                                                                           tiny_model: Path, tmp_path: Path) -> None:
    s = on_demand(stacks, tiny_model, tmp_path, max_new_tokens=1500).start()
    st = s.status()
    engines, urls = [e["pid"] for e in st["engines"]], [e["url"] for e in st["engines"]]
    _background(lambda: s.post("/v1/generate_batch", {"groups": 4}, timeout=900))
    s.wait(lambda st: st["in_flight"] > 0, timeout=60, what="generation in flight")
    assert s.rollout is not None
    os.kill(s.rollout.pid, signal.SIGKILL)            # the service only: its engines run in sessions of their own
    s.rollout.popen.wait(10)
    assert _gone(engines, 20), "engines kept running after their service was killed"
    s.start_rollout()
    assert [e["url"] for e in s.status()["engines"]] == urls
    r = s.post("/v1/generate_batch", {"groups": 1})
    assert r.status_code == 200 and r.json()["groups"] == 1, r.text



def test_the_death_signal_of_sglang_launches_ends_the_child_with_its_launcher(tmp_path: Path) -> None:
    """The preexec_fn the fleet gives SGLang engines (PR_SET_PDEATHSIG), on a stand-in child."""
    pidfile = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; from headrace.rollout.fleet import die_with_parent; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'], "
              f"preexec_fn=die_with_parent(), start_new_session=True); open({str(pidfile)!r}, 'w').write(str(p.pid)); "
              "time.sleep(3600)")
    launcher = Proc([sys.executable, "-c", script], tmp_path / "launcher.log", env=child_env())
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert _exists(child)
        os.kill(launcher.pid, signal.SIGKILL)
        assert _gone([child], 15), launcher.log()
    finally:
        launcher.stop()
        if pidfile.exists() and pidfile.read_text() and _exists(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
