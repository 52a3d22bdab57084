"""The buffer HTTP API against a real `headrace buffer serve` process on loopback.

Every endpoint and status code of DESIGN.md's table: 200/204/401/404/409/413/422/429, JSON and
msgpack bodies and answers, FIFO, min_weight_version, staleness, lease expiry, waiting leases,
and both clients (sync and async) including their 429 handling.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgpack
import orjson
import pytest

from headrace.shared.client import AsyncBufferClient, BufferClient, BufferError
from headrace.shared.schemas import Group
from tests.buffer.support import lease, make_group, start_buffer, stats
from tests.procs import free_port


def post(url: str, groups: list[dict[str, Any]], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/groups", content=orjson.dumps({"groups": groups}),
                      headers={"content-type": "application/json", **(headers or {})}, timeout=30)


@pytest.fixture(scope="module")
def buf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("buf")
    proc, url = start_buffer(d, "--db", str(d / "b.sqlite"), "--max-staleness", "1")
    yield url
    assert proc.alive(), proc.log()
    proc.stop()


def drain(url: str) -> None:
    """Lease and ack whatever is queued, so a test starts from an empty queue."""
    q = stats(url)["queued"]
    if q:
        r = lease(url, q)
        assert r.status_code == 200
        assert httpx.post(f"{url}/v1/leases/{r.json()['lease_id']}/ack").status_code == 200


def test_health_and_stats_shape(buf: str) -> None:
    r = httpx.get(buf + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert set(stats(buf)) == {"queued", "leased", "held", "consumed", "dead_lettered", "evicted_stale",
                               "duplicates", "rejected", "throttled", "policy_version", "capacity"}


def test_post_lease_ack_roundtrip_and_dedupe(buf: str) -> None:
    drain(buf)
    before = stats(buf)
    groups = [make_group(f"rt{i}") for i in range(3)]
    r = post(buf, groups)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 3 and r.json()["duplicates"] == 0
    # the same request again (a retry): all duplicates, nothing stored twice
    assert post(buf, groups).json() == {"accepted": 0, "duplicates": 3, "evicted_stale": 0}
    # a new group_id that reuses a uid is a duplicate too
    clash = make_group("rt-new")
    clash["samples"][0]["uid"] = "rt0/0"
    assert post(buf, [clash]).json()["duplicates"] == 1
    s = stats(buf)
    assert s["queued"] == before["queued"] + 3 and s["duplicates"] == before["duplicates"] + 4

    assert lease(buf, 4).status_code == 204  # exactly N or nothing
    assert stats(buf)["leased"] == 0
    r = lease(buf, 2)
    assert r.status_code == 200
    body = r.json()
    assert [Group.model_validate(g) for g in body["groups"]] == [Group.model_validate(g) for g in groups[:2]]  # FIFO
    assert body["expires_at"] > time.time()
    s = stats(buf)
    assert (s["queued"], s["leased"]) == (1, 2)
    lid = body["lease_id"]
    a = httpx.post(f"{buf}/v1/leases/{lid}/ack")
    assert a.status_code == 200 and a.json()["groups"] == 2
    again = httpx.post(f"{buf}/v1/leases/{lid}/ack")  # idempotent
    assert again.status_code == 200 and again.json()["groups"] == 0
    assert httpx.post(f"{buf}/v1/leases/{lid}/release").status_code == 409  # already consumed
    s = stats(buf)
    assert s["consumed"] == before["consumed"] + 2 and s["leased"] == 0
    # acked groups are never delivered again, and re-posting them is a duplicate
    assert post(buf, groups[:1]).json()["duplicates"] == 1
    r = lease(buf, 1)
    assert r.json()["groups"][0]["group_id"] == "rt2"
    assert httpx.post(f"{buf}/v1/leases/{r.json()['lease_id']}/ack").status_code == 200


def test_unknown_lease_is_404_and_release_requeues(buf: str) -> None:
    drain(buf)
    assert httpx.post(f"{buf}/v1/leases/nope/ack").status_code == 404
    assert httpx.post(f"{buf}/v1/leases/nope/release").status_code == 404
    assert post(buf, [make_group("rel0"), make_group("rel1")]).status_code == 200
    lid = lease(buf, 2).json()["lease_id"]
    r = httpx.post(f"{buf}/v1/leases/{lid}/release")
    assert r.status_code == 200 and r.json()["groups"] == 2
    assert httpx.post(f"{buf}/v1/leases/{lid}/release").status_code == 200  # repeat: no-op
    assert httpx.post(f"{buf}/v1/leases/{lid}/ack").status_code == 409  # released, not ackable
    assert stats(buf)["queued"] == 2
    again = lease(buf, 2).json()
    assert [g["group_id"] for g in again["groups"]] == ["rel0", "rel1"]  # back at the front, in order
    assert httpx.post(f"{buf}/v1/leases/{again['lease_id']}/ack").status_code == 200


def test_lease_expiry_returns_groups_and_late_ack_is_409(buf: str) -> None:
    drain(buf)
    assert post(buf, [make_group("exp0")]).status_code == 200
    first = lease(buf, 1, lease_s=0.3).json()
    # waiting for the expired lease's groups: the lease below only succeeds once they are back
    second = lease(buf, 1, wait_s=30)
    assert second.status_code == 200
    assert second.json()["groups"][0]["group_id"] == "exp0"
    assert httpx.post(f"{buf}/v1/leases/{first['lease_id']}/ack").status_code == 409
    assert httpx.post(f"{buf}/v1/leases/{first['lease_id']}/release").status_code == 409
    assert httpx.post(f"{buf}/v1/leases/{second.json()['lease_id']}/ack").status_code == 200


def test_waiting_lease_does_not_block_other_requests(buf: str) -> None:
    drain(buf)
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", lease(buf, 2, wait_s=60)))
    t.start()
    try:
        # while the lease waits, the service answers everything else
        for _ in range(3):
            assert httpx.get(buf + "/health", timeout=10).status_code == 200
            assert stats(buf)["queued"] == 0
        assert t.is_alive()
        assert post(buf, [make_group("w0")]).status_code == 200
        assert t.is_alive() or result["r"].status_code == 200
        assert post(buf, [make_group("w1")]).status_code == 200
    finally:
        t.join(60)
    r = result["r"]
    assert r.status_code == 200 and [g["group_id"] for g in r.json()["groups"]] == ["w0", "w1"]
    assert httpx.post(f"{buf}/v1/leases/{r.json()['lease_id']}/ack").status_code == 200
    assert lease(buf, 1, wait_s=0.2).status_code == 204


def test_min_weight_version_and_staleness(buf: str) -> None:
    drain(buf)
    base = stats(buf)
    v = base["policy_version"]
    assert post(buf, [make_group("mv-old", n=1, wv=v), make_group("mv-new", n=1, wv=v + 5)]).status_code == 200
    assert lease(buf, 2, min_weight_version=v + 5).status_code == 204
    r = lease(buf, 1, min_weight_version=v + 5)
    assert r.json()["groups"][0]["group_id"] == "mv-new"
    httpx.post(f"{buf}/v1/leases/{r.json()['lease_id']}/release")
    # max_staleness 1: version v+2 evicts queued groups with weight_version < v+1 (mv-old), keeps mv-new
    p = httpx.put(buf + "/v1/policy_version", json={"version": v + 2})
    assert p.status_code == 200 and p.json()["evicted"] == 1
    s = stats(buf)
    assert s["policy_version"] == v + 2 and s["evicted_stale"] == base["evicted_stale"] + 1 and s["queued"] == 1
    # a group that arrives already stale: 200, counted as evicted, not queued; a retry is a duplicate
    r = post(buf, [make_group("mv-stale", n=1, wv=v)])
    assert r.status_code == 200 and r.json() == {"accepted": 0, "duplicates": 0, "evicted_stale": 1}
    assert post(buf, [make_group("mv-stale", n=1, wv=v)]).json()["duplicates"] == 1
    assert stats(buf)["queued"] == 1
    assert httpx.put(buf + "/v1/policy_version", json={"version": -1}).status_code == 422
    drain(buf)
    assert httpx.put(buf + "/v1/policy_version", json={"version": v}).json()["evicted"] == 0  # for later tests


@pytest.mark.parametrize("case", ["malformed_json", "malformed_msgpack", "wrong_type", "mask_length", "nan_reward",
                                  "negative_length", "empty_group", "mixed_group_id", "no_groups", "logprob_positive",
                                  "unknown_field", "not_an_object", "huge_version"])
def test_invalid_posts_are_422_naming_the_field_and_store_nothing(buf: str, case: str) -> None:
    v = stats(buf)["policy_version"]  # earlier tests raised it: keep these groups fresh
    good = make_group(f"ok-{case}", wv=v)
    bad = make_group(f"bad-{case}", wv=v)
    ctype, expect = "application/json", None
    groups = [good, bad]
    if case == "wrong_type":
        bad["samples"][1]["tokens"] = "abc"
        expect = "groups[1].samples[1].tokens"
    elif case == "mask_length":
        bad["samples"][1]["loss_mask"] = [1]
        expect = "groups[1].samples[1].loss_mask"
    elif case == "negative_length":
        bad["samples"][0]["response_length"] = -1
        expect = "groups[1].samples[0].response_length"
    elif case == "empty_group":
        bad["samples"] = []
        expect = "groups[1].samples"
    elif case == "mixed_group_id":
        bad["samples"][1]["group_id"] = "other"
        expect = "groups[1]: samples[1].group_id"
    elif case == "logprob_positive":
        bad["samples"][0]["rollout_logprobs"][2] = 0.25
        expect = "groups[1].samples[0].rollout_logprobs"
    elif case == "unknown_field":
        bad["samples"][0]["rewardz"] = 1.0
        expect = "groups[1].samples[0].rewardz"
    before = stats(buf)
    if case == "malformed_json":
        body, expect = b'{"groups": [', "malformed JSON"
    elif case == "malformed_msgpack":
        body, ctype, expect = b"\xc1\xc1", "application/msgpack", "malformed msgpack"
    elif case == "nan_reward":
        bad["samples"][0]["reward"] = float("nan")
        body, ctype, expect = msgpack.packb({"groups": groups}), "application/msgpack", "groups[1].samples[0].reward"
    elif case == "no_groups":
        body, expect = b'{"groups": []}', "groups"
    elif case == "not_an_object":
        body, expect = b"[1, 2]", "<body>"
    elif case == "huge_version":  # beyond 64 bits: orjson reads it as a float; must be 422, not a 500
        bad["samples"][0]["weight_version"] = 123456789
        body = orjson.dumps({"groups": groups}).replace(b":123456789", b":99999999999999999999999")
        expect = "groups[1].samples[0].weight_version"
    else:
        body = orjson.dumps({"groups": groups})
    r = httpx.post(buf + "/v1/groups", content=body, headers={"content-type": ctype})
    assert r.status_code == 422, r.text
    assert expect in r.json()["detail"], r.json()
    after = stats(buf)
    assert after["queued"] == before["queued"] and after["rejected"] > before["rejected"]
    # nothing was stored: the valid group of that request is still new
    assert post(buf, [good]).json()["accepted"] == 1
    drain(buf)


def test_msgpack_bodies_and_answers(buf: str) -> None:
    drain(buf)
    v = stats(buf)["policy_version"]
    groups = [make_group(f"mp{i}", n=3, wv=v) for i in range(2)]
    r = httpx.post(buf + "/v1/groups", content=msgpack.packb({"groups": groups}),
                   headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(r.content)["accepted"] == 2
    r = httpx.post(buf + "/v1/leases", content=msgpack.packb({"groups": 1}),
                   headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
    got = msgpack.unpackb(r.content)
    assert Group.model_validate(got["groups"][0]) == Group.model_validate(groups[0])
    j = lease(buf, 1).json()  # JSON answer of a msgpack-posted group
    assert Group.model_validate(j["groups"][0]) == Group.model_validate(groups[1])
    for lid in (got["lease_id"], j["lease_id"]):
        assert httpx.post(f"{buf}/v1/leases/{lid}/ack").status_code == 200


def test_metrics_exposes_counts_and_latency(buf: str) -> None:
    r = httpx.get(buf + "/metrics")
    assert r.status_code == 200
    text = r.text
    s = stats(buf)
    assert f'headrace_buffer_groups{{state="queued"}} {float(s["queued"])}' in text
    assert f"headrace_buffer_consumed_total {float(s['consumed'])}" in text
    for name in ("evicted_stale", "duplicates", "rejected", "throttled"):
        assert f"headrace_buffer_{name}_total" in text
    assert 'headrace_buffer_request_seconds_bucket{le="0.005",method="POST",route="/v1/groups",status="200"}' in text
    assert 'route="/v1/leases/{lease_id}/ack"' in text


def test_sync_and_async_clients(buf: str) -> None:
    drain(buf)
    with BufferClient(buf) as c:
        assert c.health()
        res = c.post_groups([Group.model_validate(make_group("cl0")), make_group("cl1")])
        assert (res.accepted, res.duplicates) == (2, 0)
        assert c.lease(3) is None
        got = c.lease(2, lease_s=60)
        assert got is not None and [g.group_id for g in got.groups] == ["cl0", "cl1"]
        assert got.groups[0].samples[1].reward == 2.0
        c.release(got.lease_id)
        trusted = c.lease(2, lease_s=60, validate=False)  # built without a second validation
        assert trusted is not None and trusted.groups == got.groups
        assert trusted.groups[1].weight_version == got.groups[1].weight_version
        c.ack(trusted.lease_id)
        with pytest.raises(BufferError) as e:
            c.ack("missing")
        assert e.value.status == 404 and "missing" in e.value.message
        with pytest.raises(BufferError) as e:
            c.post_groups([{"group_id": "x", "samples": []}])
        assert e.value.status == 422 and "groups[0].samples" in e.value.message
        assert c.stats().consumed >= 2

    async def go() -> None:
        async with AsyncBufferClient(buf, msgpack=False) as a:
            assert await a.health()
            assert (await a.post_groups([make_group("acl0")])).accepted == 1
            got = await a.lease(1, wait_s=5)
            assert got is not None and got.groups[0].group_id == "acl0"
            await a.release(got.lease_id)
            got = await a.lease(1)
            await a.ack(got.lease_id)
            v = (await a.stats()).policy_version
            await a.set_policy_version(v)
            assert (await a.stats()).policy_version == v

    asyncio.run(go())


def test_capacity_429_retry_after_and_client_honours_it(tmp_path: Path) -> None:
    proc, url = start_buffer(tmp_path, "--memory", "--capacity", "3")
    try:
        assert post(url, [make_group("c0"), make_group("c1")]).status_code == 200
        r = post(url, [make_group("c2"), make_group("c3")])
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert stats(url)["throttled"] == 1 and stats(url)["queued"] == 2  # refused whole
        # a retry of an already-stored request is not refused (duplicates hold no room)
        assert post(url, [make_group("c0")]).json()["duplicates"] == 1
        # the client retries after Retry-After; room appears when a consumer acks
        out: dict[str, Any] = {}
        with BufferClient(url, retries=20, max_backoff_s=0.5) as c:
            t = threading.Thread(target=lambda: out.setdefault("res", c.post_groups([make_group("c2"), make_group("c3")])))
            t.start()
            deadline = time.monotonic() + 60
            while stats(url)["throttled"] < 2 and time.monotonic() < deadline:  # the client was refused once
                time.sleep(0.05)
            assert t.is_alive()  # ... and is waiting to retry
            lid = lease(url, 2).json()["lease_id"]
            assert httpx.post(f"{url}/v1/leases/{lid}/ack").status_code == 200
            t.join(60)
        assert out["res"].accepted == 2
        assert stats(url)["queued"] == 2
    finally:
        proc.stop()


def test_body_limit_413_and_bearer_token_401(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")   # never --token: a command line is visible to every user
    proc, url = start_buffer(tmp_path, "--memory", "--max-body-mb", "0.01", "--token-file", str(tmp_path / "token"))
    auth = {"authorization": "Bearer s3cret"}
    try:
        assert httpx.get(url + "/health").status_code == 200  # open
        assert httpx.get(url + "/metrics").status_code == 200  # open
        assert httpx.get(url + "/v1/stats").status_code == 401
        assert post(url, [make_group("t0")], headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(url + "/v1/leases", json={"groups": 1}).status_code == 401
        assert httpx.post(url + "/v1/leases/x/ack").status_code == 401
        assert httpx.put(url + "/v1/policy_version", json={"version": 1}).status_code == 401
        assert post(url, [make_group("t0")], headers=auth).status_code == 200
        big = [make_group(f"big{i}", n=4, prompt=100, response=200) for i in range(2)]  # > 10 KiB
        r = post(url, big, headers=auth)
        assert r.status_code == 413 and "max-body-mb" in r.json()["detail"]
        s = httpx.get(url + "/v1/stats", headers=auth).json()
        assert s["queued"] == 1 and s["rejected"] == 1
        with BufferClient(url, token="s3cret") as c:
            assert c.stats().queued == 1
        with BufferClient(url, token="nope", retries=0) as c, pytest.raises(BufferError) as e:
            c.stats()
        assert e.value.status == 401
    finally:
        proc.stop()


def test_client_retries_until_the_buffer_is_up(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {}
    with BufferClient(url, retries=60, backoff_s=0.1, max_backoff_s=0.5) as c:
        assert not c.health()
        t = threading.Thread(target=lambda: out.setdefault("res", c.post_groups([make_group("early")])))
        t.start()  # connection refused: the client backs off and retries
        proc, _ = start_buffer(tmp_path, "--memory", port=port)
        try:
            t.join(60)
            assert out["res"].accepted == 1
            assert c.stats().queued == 1
        finally:
            proc.stop()
    with BufferClient(url, retries=1, backoff_s=0.01) as c, pytest.raises(BufferError) as e:
        c.stats()  # down again: a clear error after the retries, no hang
    assert e.value.status == 0 and "no answer" in str(e.value)
