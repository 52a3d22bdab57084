"""Durability of the buffer across kill -9 and restarts (real processes, real SQLite file).

The claim under test: every group answered 200 is in the buffer after a kill -9 exactly once,
acked groups never come back, and leases that were not acked survive with their deadline (an ack succeeds).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from headrace.shared.schemas import Group
from tests.buffer.support import lease, make_group, start_buffer, stats


def _ack(url: str, lid: str) -> int:
    return httpx.post(f"{url}/v1/leases/{lid}/ack", timeout=10).status_code


def test_kill9_during_concurrent_posts_loses_no_answered_group(tmp_path: Path) -> None:
    db = tmp_path / "buffer.sqlite"
    proc, url = start_buffer(tmp_path, "--db", str(db), name="before")
    try:
        # state before the crash: one lease acked, one lease outstanding
        pre = [make_group(f"pre{i}") for i in range(4)]
        assert httpx.post(url + "/v1/groups", json={"groups": pre}).status_code == 200
        acked = lease(url, 2).json()
        assert _ack(url, acked["lease_id"]) == 200
        outstanding = lease(url, 2).json()

        sent: dict[str, dict[str, Any]] = {}
        answered: set[str] = set()
        lock = threading.Lock()
        stop = threading.Event()

        def producer(w: int) -> None:
            with httpx.Client(timeout=10) as c:
                i = 0
                while not stop.is_set():
                    groups = [make_group(f"w{w}-{i}-{k}", n=4, prompt=16, response=48) for k in range(1 + i % 3)]
                    with lock:
                        sent.update((g["group_id"], g) for g in groups)
                    try:
                        r = c.post(url + "/v1/groups", content=orjson.dumps({"groups": groups}),
                                   headers={"content-type": "application/json"})
                    except httpx.HTTPError:
                        return  # the buffer died under us; this POST's fate is unknown
                    if r.status_code == 200:
                        assert r.json()["accepted"] == len(groups)
                        with lock:
                            answered.update(g["group_id"] for g in groups)
                    i += 1

        threads = [threading.Thread(target=producer, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(answered) < 80 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill9()  # mid-stream: producers are still posting
        stop.set()
        for t in threads:
            t.join(30)
        assert len(answered) >= 80, "producers did not get going"
    finally:
        proc.stop()

    proc, url = start_buffer(tmp_path, "--db", str(db), name="after")
    try:
        s = stats(url)
        assert s["leased"] == 2 and s["consumed"] == 2  # the outstanding lease survived the kill
        got = lease(url, s["queued"]).json()
        ids = [g["group_id"] for g in got["groups"]]
        assert len(ids) == len(set(ids)), "a group is stored twice"
        assert answered <= set(ids), f"lost {len(answered - set(ids))} groups answered 200"
        # the outstanding lease's groups stay leased to it; the acked ones never come back
        assert not {g["group_id"] for g in outstanding["groups"]} & set(ids)
        assert not {g["group_id"] for g in acked["groups"]} & set(ids)
        # nothing invented, nothing altered
        known = {**sent, **{g["group_id"]: g for g in pre}}
        for g in got["groups"]:
            assert Group.model_validate(g) == Group.model_validate(known[g["group_id"]])
        # the lease from before the crash is still valid: acking it within its deadline succeeds
        assert _ack(url, outstanding["lease_id"]) == 200
        assert stats(url)["leased"] == len(ids)
        # a producer retrying a POST that was answered before the crash stores nothing twice
        some = sorted(answered)[:3]
        r = httpx.post(url + "/v1/groups", json={"groups": [sent[g] for g in some]})
        assert r.json() == {"accepted": 0, "duplicates": 3, "evicted_stale": 0}
        assert _ack(url, got["lease_id"]) == 200
    finally:
        proc.stop()


def test_graceful_restart_keeps_counters_and_policy_version(tmp_path: Path) -> None:
    db = tmp_path / "buffer.sqlite"
    proc, url = start_buffer(tmp_path, "--db", str(db), "--max-staleness", "0", name="one")
    try:
        assert httpx.post(url + "/v1/groups", json={"groups": [make_group("a", wv=3), make_group("b", wv=5)]}).status_code == 200
        assert httpx.post(url + "/v1/groups", json={"groups": [make_group("a", wv=3)]}).json()["duplicates"] == 1
        assert httpx.put(url + "/v1/policy_version", json={"version": 4}).json()["evicted"] == 1
        assert httpx.post(url + "/v1/groups", content=b"{", headers={"content-type": "application/json"}).status_code == 422
        before = stats(url)
    finally:
        assert proc.stop() in (0, -15)  # SIGTERM: uvicorn shuts down cleanly, then re-raises the signal
    proc, url = start_buffer(tmp_path, "--db", str(db), "--max-staleness", "0", name="two")
    try:
        after = stats(url)
        assert after == before
        assert after["policy_version"] == 4 and after["evicted_stale"] == 1 and after["queued"] == 1
        assert after["duplicates"] == 1 and after["rejected"] == 1  # saved on shutdown (no write since)
    finally:
        proc.stop()


def test_sigterm_stops_the_buffer_within_the_serving_deadline_and_keeps_what_it_answered(tmp_path: Path) -> None:
    import signal

    db = tmp_path / "buffer.sqlite"
    proc, url = start_buffer(tmp_path, "--db", str(db))
    try:
        assert httpx.post(f"{url}/v1/groups", json={"groups": [make_group("g0")]}).status_code == 200
        proc.popen.send_signal(signal.SIGTERM)
        # generous: the serving deadline is 10 s; uvicorn re-raises the signal once shut down (-15)
        assert proc.popen.wait(15) in (0, -signal.SIGTERM), proc.log()
    finally:
        proc.stop()
    again, url = start_buffer(tmp_path, "--db", str(db), name="again")
    try:
        assert stats(url)["queued"] == 1
    finally:
        again.stop()
