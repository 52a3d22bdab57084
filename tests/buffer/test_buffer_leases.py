"""The exactly-once half of the buffer (DESIGN "Exactly-once consumption"), against real processes:
extend (deadline, held), reject + dead letters, and leases that survive kill -9 of the buffer.
Both clients' ``extend_lease`` / ``reject_lease`` / ``dead_letters`` are exercised too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from headrace.shared.client import AsyncBufferClient, BufferClient, BufferError
from tests.buffer.support import lease, make_group, start_buffer, stats


def post(url: str, *gids: str) -> httpx.Response:
    return httpx.post(url + "/v1/groups", json={"groups": [make_group(g) for g in gids]}, timeout=30)


def call(url: str, lid: str, action: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/leases/{lid}/{action}", json=body, timeout=30)


def ids(r: httpx.Response) -> list[str]:
    return [g["group_id"] for g in r.json()["groups"]]


@pytest.fixture()
def buf(tmp_path: Path) -> Iterator[str]:
    proc, url = start_buffer(tmp_path, "--db", str(tmp_path / "b.sqlite"), "--capacity", "4")
    yield url
    assert proc.alive(), proc.log()
    assert "Traceback" not in proc.log(), proc.log()[-3000:]
    proc.stop()


def test_extend_moves_the_deadline_and_refuses_settled_leases(buf: str) -> None:
    assert post(buf, "e0", "e1", "e2").status_code == 200
    first = lease(buf, 1, lease_s=30).json()
    r = call(buf, first["lease_id"], "extend", {"lease_s": 3600})
    assert r.status_code == 200 and r.json()["expires_at"] > first["expires_at"] and r.json()["held"] is False
    assert call(buf, "nope", "extend", {"lease_s": 60}).status_code == 404
    assert call(buf, first["lease_id"], "ack").status_code == 200
    r = call(buf, first["lease_id"], "extend", {"lease_s": 60})
    assert r.status_code == 409 and "acked" in r.json()["detail"]
    second = lease(buf, 1).json()
    assert call(buf, second["lease_id"], "release").status_code == 200
    assert call(buf, second["lease_id"], "extend", {"lease_s": 60}).status_code == 409
    short = lease(buf, 1, lease_s=0.2).json()
    assert lease(buf, 2, wait_s=30).status_code == 200  # succeeds only once the short lease expired
    r = call(buf, short["lease_id"], "extend", {"lease_s": 60})
    assert r.status_code == 409 and "expired" in r.json()["detail"]


def test_held_groups_are_counted_apart_and_free_capacity(buf: str) -> None:
    assert post(buf, "h0", "h1", "h2", "h3").status_code == 200
    held = lease(buf, 4).json()
    r = post(buf, "h4")
    assert r.status_code == 429  # capacity 4: queued + leased (not held) is full
    r = call(buf, held["lease_id"], "extend", {"lease_s": 3600, "trained": True})
    assert r.status_code == 200 and r.json()["held"] is True
    s = stats(buf)
    assert (s["queued"], s["leased"], s["held"]) == (0, 4, 4)
    assert post(buf, "h4", "h5", "h6", "h7").json()["accepted"] == 4  # held groups do not count
    assert post(buf, "h8").status_code == 429
    r = call(buf, held["lease_id"], "extend", {"lease_s": 3600})  # trained=false keeps it held
    assert r.status_code == 200 and r.json()["held"] is True and stats(buf)["held"] == 4
    assert "state=\"held\"" in httpx.get(buf + "/metrics").text
    assert call(buf, held["lease_id"], "ack").status_code == 200
    s = stats(buf)
    assert (s["queued"], s["leased"], s["held"], s["consumed"]) == (4, 0, 0, 4)


def test_reject_dead_letters_some_groups_and_requeues_the_others_first(buf: str) -> None:
    assert post(buf, "r0", "r1", "r2").status_code == 200
    got = lease(buf, 3).json()
    lid = got["lease_id"]
    assert call(buf, lid, "reject", {"group_ids": ["r9"], "reason": "x"}).status_code == 422
    assert call(buf, "nope", "reject", {"group_ids": ["r1"], "reason": "x"}).status_code == 404
    assert post(buf, "r3").status_code == 200  # arrives after r0..r2
    r = call(buf, lid, "reject", {"group_ids": ["r1", "r1"], "reason": "token 99999 outside the vocabulary"})
    assert r.status_code == 200 and r.json() == {"lease_id": lid, "dead_lettered": 1, "requeued": 2}
    s = stats(buf)
    assert (s["queued"], s["leased"], s["dead_lettered"], s["consumed"]) == (3, 0, 1, 0)
    again = call(buf, lid, "reject", {"group_ids": ["r1"], "reason": "token 99999 outside the vocabulary"})
    assert again.status_code == 200 and again.json()["dead_lettered"] == 0  # a retry changes nothing
    assert call(buf, lid, "reject", {"group_ids": ["r0"], "reason": "x"}).status_code == 409
    assert call(buf, lid, "ack").status_code == 409 and call(buf, lid, "release").status_code == 409
    assert ids(lease(buf, 3)) == ["r0", "r2", "r3"]  # the lease's others come back ahead of later arrivals
    assert post(buf, "r1").json()["duplicates"] == 1  # a dead-lettered group is never stored again
    r = httpx.get(buf + "/v1/dead_letters")
    assert r.status_code == 200
    (dl,) = r.json()["dead_letters"]
    assert dl["group_id"] == "r1" and dl["lease_id"] == lid and "vocabulary" in dl["reason"] and dl["at"] > 0
    assert r.json()["next"] is None
    assert post(buf, "r4").status_code == 200
    short = lease(buf, 1, lease_s=0.2).json()
    assert lease(buf, 1, wait_s=30).status_code == 200  # the short lease expired
    assert call(buf, short["lease_id"], "reject", {"group_ids": ["r4"], "reason": "x"}).status_code == 409


def test_dead_letters_are_paginated_and_both_clients_follow_the_pages(tmp_path: Path) -> None:
    proc, url = start_buffer(tmp_path, "--db", str(tmp_path / "p.sqlite"))
    try:
        gids = [f"p{i:03d}" for i in range(105)]
        assert post(url, *gids).status_code == 200
        with BufferClient(url) as c:
            got = c.lease(105)
            assert got is not None
            out = c.reject_lease(got.lease_id, gids, "bad batch")
            assert out["dead_lettered"] == 105 and out["requeued"] == 0
            page = httpx.get(url + "/v1/dead_letters?limit=2").json()
            assert [d["group_id"] for d in page["dead_letters"]] == gids[:2]
            page2 = httpx.get(f"{url}/v1/dead_letters?limit=2&after={page['next']}").json()
            assert [d["group_id"] for d in page2["dead_letters"]] == gids[2:4]
            assert [d["group_id"] for d in c.dead_letters()] == gids  # 105 > one default page of 100
            with pytest.raises(BufferError) as e:
                c.extend_lease(got.lease_id, 60)
            assert e.value.status == 409
        assert stats(url)["dead_lettered"] == 105
    finally:
        proc.stop()


def test_async_client_extend_reject_dead_letters(buf: str) -> None:
    assert post(buf, "a0", "a1").status_code == 200

    async def go() -> None:
        async with AsyncBufferClient(buf) as c:
            got = await c.lease(2)
            assert got is not None
            out = await c.extend_lease(got.lease_id, 120.0, trained=True)
            assert out["held"] is True and out["lease_id"] == got.lease_id
            assert (await c.stats()).held == 2
            out = await c.reject_lease(got.lease_id, ["a1"], "no trainable token")
            assert out == {"lease_id": got.lease_id, "dead_lettered": 1, "requeued": 1}
            assert [d["group_id"] for d in await c.dead_letters()] == ["a1"]
            st = await c.stats()
            assert (st.held, st.dead_lettered, st.queued) == (0, 1, 1)

    asyncio.run(go())


def test_leases_survive_kill9_and_ack_within_the_deadline_succeeds(tmp_path: Path) -> None:
    db = str(tmp_path / "k.sqlite")
    proc, url = start_buffer(tmp_path, "--db", db, name="before")
    try:
        assert post(url, "k0", "k1", "k2", "k3", "k4", "k5").status_code == 200
        kept = lease(url, 2, lease_s=3600).json()
        held = lease(url, 2, lease_s=3600).json()
        assert call(url, held["lease_id"], "extend", {"lease_s": 3600, "trained": True}).status_code == 200
        lapsing = lease(url, 1, lease_s=1.0).json()
        rejected = lease(url, 1, lease_s=3600).json()
        assert call(url, rejected["lease_id"], "reject", {"group_ids": ["k5"], "reason": "poison"}).status_code == 200
        proc.kill9()
    finally:
        proc.stop()
    proc, url = start_buffer(tmp_path, "--db", db, name="after")
    try:
        s = stats(url)
        assert (s["held"], s["dead_lettered"], s["consumed"]) == (2, 1, 0)
        assert s["leased"] + s["queued"] == 5  # the lapsing lease may already have expired, nothing else moved
        r = call(url, kept["lease_id"], "ack")
        assert r.status_code == 200 and r.json()["groups"] == 2  # the lease survived the kill
        assert call(url, held["lease_id"], "extend", {"lease_s": 60}).json()["held"] is True
        back = lease(url, 1, wait_s=30)  # the lapsing lease expires by its deadline, across the restart
        assert back.status_code == 200 and ids(back) == ["k4"]
        assert call(url, lapsing["lease_id"], "ack").status_code == 409
        assert [d["group_id"] for d in httpx.get(url + "/v1/dead_letters").json()["dead_letters"]] == ["k5"]
        assert call(url, held["lease_id"], "ack").status_code == 200
        s = stats(url)
        assert (s["consumed"], s["held"], s["leased"], s["queued"]) == (4, 0, 1, 0)
    finally:
        proc.stop()
