"""Group commit and ``buffer.durability``: requests that arrive together share one transaction (one
fsync), each answered after it and each all or nothing on its own (real SQLite files, real processes)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import msgpack
import pytest

from headrace.buffer.policy import BufferFull
from headrace.buffer.store import GroupRow, Store
from tests.buffer.support import lease, make_group, start_buffer, stats


def row(gid: str, wv: int = 3, n: int = 2) -> GroupRow:
    return GroupRow(gid, tuple(f"{gid}/{i}" for i in range(n)), wv, msgpack.packb({"group_id": gid}))


def test_post_many_answers_each_request_on_its_own(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sqlite")
    s = Store(path, capacity=5, max_staleness=0)
    s.set_policy_version(3)
    out = s.post_many([[row("a"), row("b")],
                       [row("b"), row("c")],                       # b: a duplicate of the request before
                       [row("d"), row("e"), row("f"), row("g")],   # 3 + 4 > 5: refused whole
                       [row("old", wv=1), row("h")]])              # old: stale, recorded as evicted
    assert [(r.accepted, r.duplicates, r.evicted_stale) for r in out if not isinstance(r, BufferFull)] == \
           [(2, 0, 0), (1, 1, 0), (1, 0, 1)]
    assert isinstance(out[2], BufferFull)
    st = s.stats()
    assert (st["queued"], st["duplicates"], st["throttled"], st["evicted_stale"]) == (4, 1, 1, 1)
    s.db.close()   # like a crash: everything answered was committed
    s = Store(path, capacity=5, max_staleness=0)
    got = s.lease(4, 60, None)
    assert got is not None and [msgpack.unpackb(b)["group_id"] for b in got.blobs] == ["a", "b", "c", "h"]
    assert s.post([row("d")]).duplicates == 0 and s.post([row("a")]).duplicates == 1


@pytest.mark.parametrize("durability,level", [("process_crash", 1), ("power_loss", 2)])  # NORMAL, FULL
def test_durability_sets_sqlite_synchronous(tmp_path: Path, durability: str, level: int) -> None:
    s = Store(str(tmp_path / "s.sqlite"), capacity=5, max_staleness=0, durability=durability)
    assert s.db.execute("PRAGMA synchronous").fetchone()[0] == level
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(ValueError, match="durability must be one of"):
        Store(str(tmp_path / "t.sqlite"), capacity=5, max_staleness=0, durability="fast")


def test_concurrent_posts_with_fsync_are_all_answered_and_survive_kill9(tmp_path: Path) -> None:
    db = tmp_path / "buffer.sqlite"
    proc, url = start_buffer(tmp_path, "--db", str(db), "--durability", "power_loss", "--capacity", "60")
    answers: dict[int, tuple[int, dict]] = {}

    def post(k: int) -> None:
        # every request re-sends group s0 (a duplicate for all but the first stored): 6 + 10 x 5 groups
        # fit the capacity of 60, the other five requests are refused whole
        groups = [make_group("s0")] + [make_group(f"r{k}-{j}") for j in range(5)]
        r = httpx.post(url + "/v1/groups", json={"groups": groups}, timeout=60)
        answers[k] = (r.status_code, r.json())

    try:
        threads = [threading.Thread(target=post, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        ok = [a for code, a in answers.values() if code == 200]
        assert len(answers) == 16 and all(code in (200, 429) for code, _ in answers.values())
        assert len(ok) == 11 and sum(a["accepted"] for a in ok) == 1 + 5 * 11
        assert sum(a["duplicates"] for a in ok) == len(ok) - 1
        stored = stats(url)["queued"]
        assert stored == sum(a["accepted"] for a in ok) <= 60
        proc.kill9()
    finally:
        proc.stop()
    proc, url = start_buffer(tmp_path, "--db", str(db), name="after")
    try:
        assert stats(url)["queued"] == stored
        ids = [g["group_id"] for g in lease(url, stored).json()["groups"]]
        assert len(set(ids)) == stored and "s0" in ids
    finally:
        proc.stop()


def test_bad_durability_is_refused_naming_the_key(tmp_path: Path) -> None:
    from tests.procs import headrace_cmd
    import subprocess

    r = subprocess.run(headrace_cmd("buffer", "serve", "--durability", "sometimes"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "buffer.durability: Input should be 'process_crash' or 'power_loss'" in r.stderr


@pytest.mark.parametrize("memory", [True, False])
def test_an_in_memory_store_is_called_on_the_event_loop_a_durable_one_on_its_thread(tmp_path: Path,
                                                                                      memory: bool) -> None:
    import asyncio

    from headrace.buffer.app import BufferService
    from headrace.shared.config import BufferConfig

    async def main() -> None:
        svc = BufferService(BufferConfig(memory=memory, db=None if memory else str(tmp_path / "b.sqlite")))
        await svc.start()
        try:
            here = threading.get_ident()
            assert (await svc.db(threading.get_ident) == here) is memory
            # a request's groups are committed and answered the same way either way
            got = await svc.post([row("a"), row("b")])
            assert (got.accepted, got.duplicates) == (2, 0)
            again = await asyncio.gather(svc.post([row("b")]), svc.post([row("c")]))
            assert [(r.accepted, r.duplicates) for r in again] == [(0, 1), (1, 0)]
            assert svc.stats()["queued"] == 3
        finally:
            await svc.stop()

    asyncio.run(main())
