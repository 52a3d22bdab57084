"""The buffer's store and rules in-process (real SQLite files): restart, leases, staleness, capacity.

The HTTP tests prove the service end to end; these pin the store's semantics directly, with an
explicit clock instead of sleeps.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import msgpack
import pytest

from headrace.buffer.ingest import parse_groups
from headrace.buffer.policy import BufferFull, LeaseConflict, LeaseNotFound, LeaseState, NotInLease, lease_transition
from headrace.shared.staleness import is_stale
from headrace.buffer.store import GroupRow, Store
from headrace.shared import wire
from tests.buffer.support import make_group


def row(gid: str, wv: int = 0, n: int = 2) -> GroupRow:
    return GroupRow(gid, tuple(f"{gid}/{i}" for i in range(n)), wv, msgpack.packb({"group_id": gid}))


def test_post_dedupes_by_group_id_and_uid_within_and_across_requests(tmp_path: Path) -> None:
    s = Store(str(tmp_path / "s.sqlite"), capacity=100, max_staleness=1)
    res = s.post([row("a"), row("b"), row("a")])
    assert (res.accepted, res.duplicates) == (2, 1)
    clash = GroupRow("c", ("b/1",), 0, b"\x80")
    assert s.post([clash]).duplicates == 1
    assert s.stats()["queued"] == 2 and s.stats()["duplicates"] == 2


def test_restart_keeps_leases_until_their_deadline_and_keeps_acks(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sqlite")
    s = Store(path, capacity=100, max_staleness=1)
    s.post([row(f"g{i}") for i in range(7)])
    acked = s.lease(2, 60, None, now=1000.0)
    open_lease = s.lease(2, 60, None, now=1000.0)
    lapsing = s.lease(2, 5, None, now=1000.0)
    assert acked and open_lease and lapsing
    assert s.ack(acked.lease_id, now=1001.0) == 2
    s.db.close()  # like a crash: no close(), no final counter save
    s = Store(path, capacity=100, max_staleness=1)
    st = s.stats()
    assert (st["queued"], st["leased"], st["consumed"]) == (1, 4, 2)  # durable leases (DESIGN "Exactly-once")
    assert s.ack(open_lease.lease_id, now=1002.0) == 2  # within its deadline: the ack succeeds after the restart
    with pytest.raises(LeaseConflict):
        s.ack(lapsing.lease_id, now=1006.0)  # past its deadline: expired, its groups are back
    again = s.lease(3, 60, None, now=1007.0)
    assert again is not None
    assert [msgpack.unpackb(b)["group_id"] for b in again.blobs] == ["g4", "g5", "g6"]  # FIFO by first arrival


def test_expiry_by_clock_and_lease_state_machine(tmp_path: Path) -> None:
    s = Store(None, capacity=10, max_staleness=1)
    s.post([row("a"), row("b")])
    lease = s.lease(2, 5.0, None, now=100.0)
    assert lease is not None and s.lease(1, 5.0, None, now=101.0) is None
    assert s.next_expiry() == 105.0
    assert s.expire(now=104.0) == 0
    with pytest.raises(LeaseConflict):
        s.ack(lease.lease_id, now=106.0)
    assert s.stats()["queued"] == 2 and s.stats()["leased"] == 0
    with pytest.raises(LeaseNotFound):
        s.release("nope")
    assert lease_transition(LeaseState.active, "ack", False) == (True, LeaseState.acked)
    assert lease_transition(LeaseState.acked, "ack", True) == (False, LeaseState.acked)
    with pytest.raises(LeaseConflict):
        lease_transition(LeaseState.released, "ack", False)


def test_min_weight_version_staleness_and_capacity() -> None:
    s = Store(None, capacity=3, max_staleness=2)
    s.post([row("v0", 0), row("v3", 3), row("v5", 5)])
    assert s.lease(2, 10, 3) is not None  # v3 and v5
    with pytest.raises(BufferFull) as e:
        s.post([row("x", 5)])
    assert e.value.retry_after_s >= 1 and s.stats()["throttled"] == 1
    assert s.post([row("v0", 0)]).duplicates == 1  # duplicates never count against capacity
    assert s.set_policy_version(3) == 1  # 0 < 3 - 2: v0 evicted; leased groups are left alone
    st = s.stats()
    assert (st["queued"], st["leased"], st["evicted_stale"], st["policy_version"]) == (0, 2, 1, 3)
    assert s.post([row("late", 0)]).evicted_stale == 1
    assert is_stale(0, 3, 2) and not is_stale(1, 3, 2)


def test_groups_back_from_a_lease_are_evicted_when_the_version_moved_past_them(tmp_path: Path) -> None:
    """The fault test's stall: a killed trainer's leases lapse after the resumed trainer moved the
    version on. Their groups must not sit queued under the lease floor, counted as backlog that
    blocks admission while no lease can take them: expiry, release and a reject's requeue evict them."""
    path = str(tmp_path / "s.sqlite")
    s = Store(path, capacity=100, max_staleness=1)
    s.post([row("old1", 1), row("old2", 1), row("old3", 1), row("old4", 1), row("r1", 1), row("r2", 1), row("new", 5)])
    lapsing = s.lease(2, 5.0, None, now=100.0)
    released = s.lease(2, 60.0, None, now=100.0)
    rejected = s.lease(2, 60.0, None, now=100.0)
    assert lapsing and released and rejected
    assert s.set_policy_version(5) == 0  # 1 < 5 - 1, but leased groups are left to their lease
    st = s.stats()
    assert (st["queued"], st["leased"], st["evicted_stale"]) == (1, 6, 0)
    assert s.expire(now=106.0) == 2  # back from the lapsed lease ...
    st = s.stats()
    assert (st["queued"], st["leased"], st["evicted_stale"]) == (1, 4, 2)  # ... and evicted there and then
    assert s.release(released.lease_id, now=107.0) == 2
    assert s.reject(rejected.lease_id, ["r1"], "bad", now=107.0) == (1, 1)
    st = s.stats()
    assert (st["queued"], st["leased"], st["evicted_stale"], st["dead_lettered"]) == (1, 0, 5, 1)
    got = s.lease(1, 60.0, 4, now=108.0)  # the trainer's floor at version 5 finds the only queued group
    assert got is not None and msgpack.unpackb(got.blobs[0])["group_id"] == "new"
    s.db.close()
    s = Store(path, capacity=100, max_staleness=1)  # the evictions were committed with the moves
    st = s.stats()
    assert (st["queued"], st["leased"], st["evicted_stale"], st["dead_lettered"]) == (0, 1, 5, 1)
    assert s.to_purge and s.purge(100) == 5


def test_ingest_msgpack_blobs_are_the_client_bytes_and_json_is_packed() -> None:
    groups = [make_group("i0"), make_group("i1", n=3)]
    body = msgpack.packb({"groups": groups})
    rows = parse_groups(body, "application/msgpack")
    assert [r.group_id for r in rows] == ["i0", "i1"] and rows[1].uids == ("i1/0", "i1/1", "i1/2")
    assert b"".join(r.blob for r in rows) in body  # sliced, not re-encoded
    jrows = parse_groups(wire.dumps_json({"groups": groups}), "application/json")
    assert [msgpack.unpackb(r.blob) for r in jrows] == groups
    assert rows[0].weight_version == 0
    with pytest.raises(wire.WireError) as e:
        parse_groups(msgpack.packb({"groups": groups, "extra": 1}), "application/msgpack")
    assert "extra" in e.value.message and e.value.groups == 2  # type: ignore[attr-defined]


def test_payloads_of_consumed_and_evicted_groups_are_purged(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sqlite")
    s = Store(path, capacity=100, max_staleness=0)
    s.post([row("a", 1), row("b", 1), row("c", 0)])
    lease = s.lease(1, 60, 1)
    assert lease is not None
    s.ack(lease.lease_id)
    assert s.set_policy_version(1) == 1  # c evicted
    blobs = lambda: s.db.execute("SELECT COUNT(*) FROM payloads").fetchone()[0]  # noqa: E731
    assert blobs() == 3 and s.to_purge  # ack and eviction leave the payload for later
    s.db.close()
    s = Store(path, capacity=100, max_staleness=0)  # the purge queue survives a crash
    assert s.to_purge and s.purge(1) == 1 and s.purge(10) == 1 and s.purge(10) == 0
    assert blobs() == 1 and not s.to_purge
    got = s.lease(1, 60, None)
    assert got is not None and msgpack.unpackb(got.blobs[0])["group_id"] == "b"


def test_held_leases_expire_like_others_and_reject_checks_membership(tmp_path: Path) -> None:
    s = Store(str(tmp_path / "h.sqlite"), capacity=2, max_staleness=1)
    s.post([row("a"), row("b")])
    held = s.lease(2, 10.0, None, now=100.0)
    assert held is not None
    assert s.extend(held.lease_id, 10.0, trained=True, now=105.0) == (115.0, True)
    assert s.post([row("c")]).accepted == 1  # held groups leave room under the capacity
    assert s.stats()["held"] == 2 and s.next_expiry() == 115.0
    assert s.expire(now=116.0) == 2  # a held lease the trainer stopped extending lapses like any other
    st = s.stats()
    assert (st["queued"], st["leased"], st["held"]) == (3, 0, 0)
    with pytest.raises(LeaseConflict):
        s.extend(held.lease_id, 10.0, now=117.0)
    other = s.lease(2, 10.0, None, now=120.0)
    assert other is not None
    with pytest.raises(NotInLease):
        s.reject(other.lease_id, ["c"], "not mine", now=121.0)
    assert s.reject(other.lease_id, ["b"], "bad", now=121.0) == (1, 1)
    page, nxt = s.dead_letters(0, 10)
    assert [(d["group_id"], d["reason"], d["at"]) for d in page] == [("b", "bad", 121.0)] and nxt is None


def test_wal_checkpoints_run_on_their_own_thread_and_lose_nothing(tmp_path: Path) -> None:
    db = tmp_path / "b.sqlite"
    s = Store(str(db), 10**6, 10**6)
    assert s.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0   # never inside a commit
    assert s.checkpointer is not None
    big = b"\x00" * (256 << 10)
    for i in range(40):   # ~10 MB of blobs: WAL frames to copy
        s.post([GroupRow(f"g{i}", (f"g{i}/0",), 0, big)])
    deadline = time.monotonic() + 30
    while s.checkpointer.checkpoints < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s.checkpointer.checkpoints >= 1, "no background checkpoint"
    with sqlite3.connect(db) as other:   # everything committed is in the database file now
        busy, frames, done = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and frames == done
    s.close()
    assert not s.checkpointer._thread.is_alive()
    assert not os.path.exists(f"{db}-wal") or os.path.getsize(f"{db}-wal") <= 64 << 20
    again = Store(str(db), 10**6, 10**6)
    try:
        got = again.lease(40, 60, None)
        assert got is not None and got.blobs == [big] * 40
    finally:
        again.close()


@pytest.mark.parametrize("restart", [True, False])
def test_the_wal_stays_bounded_under_writes_that_never_pause(tmp_path: Path, restart: bool) -> None:
    # A PASSIVE checkpoint copies the frames present when it starts; a writer that commits again
    # while it copies keeps it from ever catching up, so SQLite never starts the WAL over by itself
    # (restart=False shows it: no reset in 150 commits). The checkpointer asks the store for a
    # RESTART once the WAL outgrows restart_bytes.
    from headrace.buffer.checkpointer import WalCheckpointer

    db = tmp_path / "b.sqlite"
    s = Store(str(db), 10**6, 10**6)
    assert s.checkpointer is not None
    s.checkpointer.stop()   # this test's own, checking every 20 ms
    s.checkpointer = ck = WalCheckpointer(str(db), interval_s=0.02, restart_bytes=(4 << 20) if restart else 1 << 40)
    blob = os.urandom(1 << 10)   # payloads go to segment files: the WAL grows from ~320 KB of uids a commit
    uids = lambda n: tuple(f"g{n}/{k:03d}/" + "u" * 800 for k in range(400))  # noqa: E731
    wal = Path(f"{db}-wal")

    def resets() -> int:   # the WAL header's checkpoint sequence: +1 each time the WAL starts over
        with wal.open("rb") as f:
            return int.from_bytes(f.read(16)[12:16], "big")

    s.db.execute(f"PRAGMA journal_size_limit={4 << 20}")   # what a WAL that starts over is cut back to
    s.post([GroupRow("g0", uids(0), 0, blob)])
    first, largest, n = resets(), 0, 1
    after_reset: list[int] = []   # the WAL file's size after each commit that started it over
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (len(after_reset) < 3 if restart else n < 150):
            before = resets()
            s.post([GroupRow(f"g{n}", uids(n), 0, blob)])
            n += 1
            largest = max(largest, wal.stat().st_size)
            if resets() != before:
                after_reset.append(wal.stat().st_size)
    finally:
        ck.stop()
    if restart:
        assert len(after_reset) >= 3 and ck.restarts >= 3, (after_reset, ck.restarts, n)
        # the commit that starts the WAL over cuts the file back to journal_size_limit (one commit
        # of ~0.6 MB is all it holds then); how big it grew between resets depends on the disk
        assert all(size <= 4 << 20 for size in after_reset), after_reset
    else:
        assert resets() == first and ck.restarts == 0 and largest > 32 << 20, (largest, n)
    s.close()
    again = Store(str(db), 10**6, 10**6)
    try:   # nothing committed was lost on the way
        got = again.lease(n, 60, None)
        assert got is not None and len(got.blobs) == n and all(b == blob for b in got.blobs)
    finally:
        again.close()
