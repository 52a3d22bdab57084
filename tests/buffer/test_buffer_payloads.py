"""The buffer's payload segments (buffer/payloads.py) through the real store: files on disk, real
SQLite, reopened as after a crash."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path

import msgpack
import pytest

from headrace.buffer import payloads
from headrace.buffer.store import GroupRow, Store


def row(gid: str, size: int = 0) -> GroupRow:
    return GroupRow(gid, (f"{gid}/0",), 0, msgpack.packb({"group_id": gid, "pad": b"p" * size}))


def segments(db: Path) -> list[str]:
    return sorted(p.name for p in Path(f"{db}.blobs").glob("*.seg"))


def test_segments_roll_over_and_go_once_no_group_needs_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payloads, "SEGMENT_BYTES", 100_000)
    db = tmp_path / "b.sqlite"
    s = Store(str(db), 1000, 10)
    for i in range(12):   # ~40 KB a request: a new segment every two or three requests
        assert s.post([row(f"g{i}", 40_000)]).accepted == 1
    assert len(segments(db)) >= 4
    first = s.lease(6, 60, None)
    assert first is not None and [msgpack.unpackb(b)["group_id"] for b in first.blobs] == [f"g{i}" for i in range(6)]
    s.ack(first.lease_id)
    before = segments(db)
    while s.purge(2):
        pass
    after = segments(db)
    assert len(after) < len(before) and after == before[-len(after):]   # the oldest went, in order
    spares = sorted(Path(f"{db}.blobs").glob("*.spare"))
    assert len(spares) == 2   # two freed files kept for reuse, the others deleted
    assert s.post([row("g12", 90_000)]).accepted == 1   # a new segment: a spare written again
    assert len(list(Path(f"{db}.blobs").glob("*.spare"))) == 1 and len(segments(db)) == len(after) + 1
    rest = s.lease(7, 60, None)
    assert rest is not None and [msgpack.unpackb(b)["group_id"] for b in rest.blobs] == [f"g{i}" for i in range(6, 13)]
    s.ack(rest.lease_id)
    while s.purge(5):
        pass
    assert len(segments(db)) == 1   # the one being written stays until a new one starts
    s.close()
    Path(f"{db}.blobs/99999999.seg").write_bytes(b"left by a crash")
    again = Store(str(db), 1000, 10)   # open: files no ref points to are deleted
    try:
        assert segments(db) == []
        assert again.post([row("late")]).accepted == 1 and len(segments(db)) == 1
        got = again.lease(1, 60, None)
        assert got is not None and msgpack.unpackb(got.blobs[0])["group_id"] == "late"
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_payload_lost_on_disk_is_dead_lettered_never_served(tmp_path: Path, damage: str) -> None:
    # what an OS crash under process_crash durability can leave: a commit whose bytes never reached
    # the disk (or a file damaged by hand)
    db = tmp_path / "b.sqlite"
    s = Store(str(db), 1000, 10, durability="power_loss")   # fdatasync path
    s.post([row("a", 5000), row("b", 5000)])
    s.post([row("c", 5000)])
    seg, off, n = s.db.execute("SELECT segment, offset, length FROM payloads p JOIN groups g "
                                    "ON g.seq = p.seq WHERE group_id='b'").fetchone()
    s.close()
    f = Path(f"{db}.blobs/{seg:08d}.seg")
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[off + n // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[:off + n - 1]))
    elif damage == "remove":   # every payload of the segment is gone
        f.unlink()
    lost = {"flip": {"b"}, "truncate": {"b", "c"}, "remove": {"a", "b", "c"}}[damage]   # c follows b in the file
    again = Store(str(db), 1000, 10)
    try:
        assert again.lease(3, 60, None) is None   # the damaged ones leave the queue on the way
        got = again.lease(3 - len(lost), 60, None) if len(lost) < 3 else None
        served = sorted(msgpack.unpackb(b)["group_id"] for b in got.blobs) if got else []
        assert served == sorted({"a", "b", "c"} - lost)   # every intact payload, never a damaged one
        dead, _ = again.dead_letters()
        assert {d["group_id"] for d in dead} == lost, dead
        assert all(d["reason"].startswith("payload lost") and d["lease_id"] == "" for d in dead)
        stats = again.stats()
        assert stats["dead_lettered"] == len(lost) and stats["queued"] == 0 and stats["leased"] == 3 - len(lost)
    finally:
        again.close()


def test_refs_carry_zlibs_crc32_whichever_implementation_computes_it(tmp_path: Path) -> None:
    """The checksum on disk is zlib's CRC-32 (isal computes the same values faster): a store written
    by either implementation, or before isal was used, reads back under the other."""
    db = tmp_path / "b.sqlite"
    s = Store(str(db), 1000, 10)
    rows = [row(f"g{i}", 1000 * i) for i in range(1, 4)]
    s.post(rows)
    stored = s.db.execute("SELECT crc FROM payloads ORDER BY seq").fetchall()
    assert [c for (c,) in stored] == [zlib.crc32(r.blob) for r in rows]
    assert payloads.crc32(b"headrace" * 5000) == zlib.crc32(b"headrace" * 5000)
    s.close()
    s = Store(str(db), 1000, 10)   # reopened: every ref's bytes check out
    got = s.lease(3, 60, None)
    assert got is not None and got.blobs == [r.blob for r in rows]
    s.close()


def test_a_rolled_back_post_leaves_no_reference_and_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "b.sqlite"
    s = Store(str(db), 1000, 10)
    s.post([row("a", 1000)])
    with pytest.raises(TypeError):   # a weight version SQLite cannot bind: the transaction rolls back after put
        s.post_many([[row("b", 1000)], [GroupRow("x", ("x/0",), object(), b"x")]])  # type: ignore[arg-type]
    assert s.payloads.refs == {1: 1} and s.stats()["queued"] == 1
    assert s.post([row("b", 1000)]).accepted == 1   # after the unreferenced bytes
    got = s.lease(2, 60, None)
    assert got is not None and [msgpack.unpackb(b)["group_id"] for b in got.blobs] == ["a", "b"]
    s.close()


def test_a_dead_letter_keeps_its_payload_in_sqlite_not_its_segment(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payloads, "SEGMENT_BYTES", 50_000)
    db = tmp_path / "b.sqlite"
    s = Store(str(db), 1000, 10)
    s.post([row("a", 30_000), row("b", 30_000)])   # one segment
    s.post([row("c", 30_000)])                      # the next
    lease = s.lease(2, 60, None)
    assert lease is not None and len(segments(db)) == 2
    assert s.reject(lease.lease_id, ["a"], "bad reward") == (1, 1)
    kept = s.db.execute("SELECT data FROM blobs b JOIN groups g ON g.seq = b.seq WHERE group_id='a'").fetchone()
    assert kept is not None and msgpack.unpackb(kept[0])["group_id"] == "a"
    rest = s.lease(2, 60, None)
    assert rest is not None and sorted(msgpack.unpackb(b)["group_id"] for b in rest.blobs) == ["b", "c"]
    s.ack(rest.lease_id)
    while s.purge():
        pass
    assert len(segments(db)) == 1   # the first segment went although "a" is kept for good
    assert s.stats()["dead_lettered"] == 1
    s.close()


def test_the_memory_store_keeps_payloads_in_sqlite() -> None:
    s = Store(None, 10, 10)
    s.post([row("a", 100)])
    assert s.db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 1 and s.payloads.dir is None
    got = s.lease(1, 60, None)
    assert got is not None and msgpack.unpackb(got.blobs[0])["group_id"] == "a"
    s.ack(got.lease_id)
    assert s.purge() == 1 and s.db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0
    s.close()
    assert os.path.exists(":memory:.blobs") is False


def test_kill9_during_ingest_loses_no_answered_group_and_damages_none(tmp_path: Path) -> None:
    """A real buffer, 3 producers posting column bodies without pause, kill -9, restart on the
    same files: every group answered 200 is leased back with exactly its bytes' content."""
    import threading

    import httpx

    from headrace.shared import columns
    from tests.buffer.support import make_group, start_buffer, stats

    db = tmp_path / "k.sqlite"
    proc, url = start_buffer(tmp_path, "--db", str(db), name="k1")
    answered: list[str] = []
    sent: dict[str, list[int]] = {}
    stop = threading.Event()

    def produce(p: int) -> None:
        with httpx.Client(timeout=10) as c:
            for i in range(10_000):
                groups = [make_group(f"p{p}-{i}-{k}", n=4, response=3000) for k in range(4)]
                for k, g in enumerate(groups):
                    g["samples"][0]["tokens"][5] = (p * 10_000 + i * 4 + k) % 50_000   # each group its own bytes
                    sent[g["group_id"]] = g["samples"][0]["tokens"]
                try:
                    r = c.post(url + "/v1/groups", content=columns.encode(groups),
                               headers={"content-type": columns.COLUMNS})
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    answered.extend(g["group_id"] for g in groups)
                if stop.is_set():
                    return

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while len(answered) < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill9()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        proc.stop()
    assert len(answered) >= 300
    proc, url = start_buffer(tmp_path, "--db", str(db), name="k2")
    try:
        queued = stats(url)["queued"]
        assert queued >= len(answered)   # committed but unanswered ones may be there too
        r = httpx.post(url + "/v1/leases", json={"groups": queued}, headers={"accept": columns.COLUMNS}, timeout=60)
        assert r.status_code == 200, r.text
        cols, _ = columns.decode(r.content, ("lease_id", "expires_at"))
        rows = cols.to_rows()
        got = [g["group_id"] for g in rows]
        assert len(got) == len(set(got)) and set(answered) <= set(got)
        assert all(g["samples"][0]["tokens"] == sent[g["group_id"]] for g in rows)
        assert stats(url)["dead_lettered"] == 0
    finally:
        proc.stop()
