"""The buffer's embedded store: SQLite in WAL mode, one row per group.

Guarantees (file-backed store):
- ``post`` / ``post_many`` commit before they return. The database runs in WAL mode; what a
  returned post survives is ``durability`` (``buffer.durability``):
  ``process_crash`` (default, ``synchronous=NORMAL``): the commit has written its WAL frames to the
  OS before it returns, so kill -9 of the buffer loses nothing (DESIGN's promise); an OS crash or
  power loss may lose the last commits, never the database's consistency. ``power_loss``
  (``synchronous=FULL``): the WAL is fsynced at every commit, so an OS crash or power loss loses
  nothing either. The fsync is what that costs: 8-20 ms per commit measured on this machine's
  disk (1 MB of WAL), more than the rest of a 1 MB ingest; ``post_many`` shares one commit (one
  fsync) among the requests that arrived together (group commit).
- A request is all or nothing: its capacity check and every insert happen in one transaction.
  Within ``post_many`` a request refused as full is refused before it writes anything, so the
  others of the batch are stored; an SQLite error fails them all, nothing of them stored.
- A group_id or a uid seen before (queued, leased, consumed or evicted) is a duplicate: counted,
  not stored. Rows of consumed and evicted groups keep their ids and drop their payload.
- ``ack`` is durable like ``post``; an acked group is never leased again.
- Leases are durable too (DESIGN "Exactly-once consumption"): a lease, its groups, its deadline
  and its *held* mark survive a restart, so an ack within the deadline succeeds after one. A
  lease whose deadline passed (while the buffer ran or while it was down) expires and its groups
  are queued again, ahead of later arrivals (FIFO by first arrival).
- The queue never holds a stale group: groups that come back to it (a lease released, expired
  or partly rejected) are evicted as stale there and then when the recorded policy version has
  moved past them, as ``set_policy_version`` evicts queued ones.
- ``extend`` moves a deadline; ``trained=True`` marks the lease held: its groups stay in
  ``leased`` and are also counted in ``held``, and the capacity rule counts queued + leased - held.
- ``reject`` moves some groups of a lease to the dead-letter table (durable, with reason and time;
  their ids stay known, so they are never stored again) and queues the lease's other groups,
  ahead of every later arrival (the queue is ordered by first arrival).

- A payload found missing or damaged when leased (``buffer.payloads``) is dead-lettered, never served.

Each group is one small row of indexed columns (seq, group_id, weight_version, state, lease_id);
its payload (msgpack or column blob) is kept by ``buffer.payloads`` (segment files beside the
database; a table in memory), so state changes (lease, ack, expiry) rewrite a few bytes and never
the payload. Payloads of consumed and evicted groups are deleted in small batches by ``purge``
(called when idle), off the ack path; WAL checkpoints run on their own thread
(``buffer.checkpointer``), never inside a commit (after one, when the WAL outgrew 256 MB under
writes that never pause, a RESTART checkpoint starts it over). With ``path=None`` the database
lives in memory: same semantics, not durable.

Not thread-safe: the app calls every method from one dedicated thread.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass, field

from headrace.buffer.checkpointer import WalCheckpointer
from headrace.buffer.payloads import SCHEMA as PAYLOADS_SCHEMA
from headrace.buffer.payloads import MAX_VARS, Payloads, Transaction, chunks
from headrace.buffer.policy import (BufferFull, GroupState, LeaseConflict, LeaseNotFound, LeaseState, NotInLease,
                                    lease_transition, retry_after_s)
from headrace.shared.staleness import stale_cutoff

_SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL UNIQUE,
    weight_version INTEGER NOT NULL,
    state INTEGER NOT NULL,
    lease_id TEXT
);
CREATE TABLE IF NOT EXISTS purge (seq INTEGER PRIMARY KEY);
CREATE INDEX IF NOT EXISTS groups_state_seq ON groups(state, seq);
CREATE INDEX IF NOT EXISTS groups_lease ON groups(lease_id) WHERE lease_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS uids (uid TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    state INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    n INTEGER NOT NULL,
    held INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    seq INTEGER NOT NULL,
    group_id TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_letters_lease ON dead_letters(lease_id);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
"""

_SYNC = {"process_crash": "NORMAL", "power_loss": "FULL"}   # buffer.durability -> PRAGMA synchronous
# the WAL file is cut back to this when it starts over, and started over past it (buffer.checkpointer);
# 64 MB cost 8% of a sustained 4-producer ingest (fleet_sim), 256 MB ~2%: fewer restarts, and the
# WAL rewrites pages the OS already holds instead of growing into new ones
_WAL_KEEP_BYTES = 256 << 20
_COUNTERS = ("duplicates", "rejected", "throttled", "policy_version")


@dataclass(frozen=True)
class GroupRow:
    """What the store needs of one validated group."""

    group_id: str
    uids: tuple[str, ...]
    weight_version: int
    blob: bytes


@dataclass
class PostResult:
    accepted: int = 0
    duplicates: int = 0
    evicted_stale: int = 0


@dataclass
class Lease:
    lease_id: str
    expires_at: float
    blobs: list[bytes] = field(default_factory=list)


class Store:
    """SQLite-backed queue of groups with leases. ``path=None``: in memory (not durable)."""

    def __init__(self, path: str | None, capacity: int, max_staleness: int, durability: str = "process_crash") -> None:
        if durability not in _SYNC:
            raise ValueError(f"durability must be one of {sorted(_SYNC)}, not {durability!r}")
        self.path = path
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.db = sqlite3.connect(path or ":memory:", isolation_level=None, check_same_thread=False)
        # only takes effect on a new database: payloads live in segment files beside a file (small
        # pages: a commit writes whole pages to the WAL), in 64 KiB pages' overflow chains in memory
        self.db.execute(f"PRAGMA page_size={4096 if path else 65536}")
        if path:
            mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"{path}: SQLite refused WAL mode (got {mode!r})")
            self.db.execute(f"PRAGMA synchronous={_SYNC[durability]}")
            # checkpoints run on their own thread (buffer.checkpointer), never inside a post's or an ack's commit
            self.db.execute("PRAGMA wal_autocheckpoint=0")
            self.db.execute(f"PRAGMA journal_size_limit={_WAL_KEEP_BYTES}")
        if self.db.execute("SELECT 1 FROM sqlite_master WHERE name='leases'").fetchone() is not None and \
                "held" not in {r[1] for r in self.db.execute("PRAGMA table_info(leases)")}:
            self.db.execute("ALTER TABLE leases ADD COLUMN held INTEGER NOT NULL DEFAULT 0")  # a pre-held database
        self.db.executescript(_SCHEMA + PAYLOADS_SCHEMA)
        self.payloads = Payloads(self.db, path, sync=durability == "power_loss")
        self.counters = {k: 0 for k in _COUNTERS}
        for key, value in self.db.execute("SELECT key, value FROM meta"):
            if key in self.counters:
                self.counters[key] = value
        counts = dict(self.db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
        self.n = {s: counts.get(int(s), 0) for s in GroupState}
        self.active: dict[str, float] = {}  # active lease id -> expires_at
        self.held: dict[str, int] = {}  # active held lease id -> its groups
        self._recover()
        self.to_purge = self.db.execute("SELECT 1 FROM purge LIMIT 1").fetchone() is not None
        self.checkpointer = WalCheckpointer(path, restart_bytes=_WAL_KEEP_BYTES) if path else None

    # ---- helpers ---------------------------------------------------------------------------

    def _recover(self) -> None:
        """Leases active when the process stopped stay active until their deadline (``expire``)."""
        for lid, expires_at, n, held in self.db.execute("SELECT lease_id, expires_at, n, held FROM leases WHERE state=?",
                                                        (LeaseState.active,)):
            self.active[lid] = expires_at
            if held:
                self.held[lid] = n

    def _txn(self) -> Transaction:
        return Transaction(self.db, self.payloads, self.checkpointer)

    def _save_counters(self) -> None:
        self.db.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", list(self.counters.items()))

    def _move(self, src: GroupState, dst: GroupState, k: int) -> None:
        self.n[src] -= k
        self.n[dst] += k

    def _existing(self, table: str, column: str, values: list[str]) -> set[str]:
        found: set[str] = set()
        for marks, c in chunks(values):
            found.update(r[0] for r in self.db.execute(f"SELECT {column} FROM {table} WHERE {column} IN ({marks})", c))
        return found

    # ---- operations ------------------------------------------------------------------------

    def post(self, rows: list[GroupRow]) -> PostResult:
        """Store new groups; duplicates are counted, stale ones recorded as evicted. Raises BufferFull."""
        (res,) = self.post_many([rows])
        if isinstance(res, BufferFull):
            raise res
        return res

    def post_many(self, requests: list[list[GroupRow]]) -> list[PostResult | BufferFull]:
        """``post`` of several requests in one transaction (one commit, one fsync): each request's
        answer, a ``PostResult`` or the ``BufferFull`` that refused it whole. Requests are applied
        in order, so a later one sees an earlier one's groups as duplicates."""
        out: list[PostResult | BufferFull] = []
        saved = dict(self.counters)
        queued = evicted = 0
        try:
            with self._txn():
                for rows in requests:
                    res = self._post_one(rows, queued)
                    out.append(res)
                    if isinstance(res, PostResult):
                        queued += res.accepted
                        evicted += res.evicted_stale
                self._save_counters()
        except BaseException:
            self.counters = saved
            raise
        self.n[GroupState.queued] += queued
        self.n[GroupState.evicted] += evicted
        return out

    def _post_one(self, rows: list[GroupRow], queued_before: int) -> PostResult | BufferFull:
        """One request inside ``post_many``'s transaction; ``queued_before``: groups queued by the
        requests before it in the same transaction (not yet in ``self.n``)."""
        res = PostResult()
        seen_g = self._existing("groups", "group_id", [r.group_id for r in rows])
        seen_u = self._existing("uids", "uid", [u for r in rows for u in r.uids])
        cutoff = stale_cutoff(self.counters["policy_version"], self.max_staleness)
        new: list[tuple[GroupRow, bool]] = []
        for r in rows:
            if r.group_id in seen_g or any(u in seen_u for u in r.uids):
                res.duplicates += 1
                continue
            seen_g.add(r.group_id)
            seen_u.update(r.uids)
            stale = r.weight_version < cutoff
            new.append((r, stale))
        queued_new = sum(1 for _, stale in new if not stale)
        counted = self.n[GroupState.queued] + queued_before + self.n[GroupState.leased] - self.n_held
        if queued_new and counted + queued_new > self.capacity:
            overflow = counted + queued_new - self.capacity
            self.counters["throttled"] += 1
            return BufferFull(f"buffer full: {counted} of {self.capacity} groups queued or leased (not held), "
                              f"request adds {queued_new}", retry_after_s(overflow, self.capacity))
        self.counters["duplicates"] += res.duplicates
        kept: list[tuple[int, bytes]] = []
        for r, stale in new:
            cur = self.db.execute("INSERT INTO groups(group_id, weight_version, state) VALUES (?, ?, ?)",
                                  (r.group_id, r.weight_version, GroupState.evicted if stale else GroupState.queued))
            if not stale:
                kept.append((cur.lastrowid, r.blob))
        self.payloads.put(kept)
        if new:
            self.db.executemany("INSERT INTO uids(uid) VALUES (?)", [(u,) for r, _ in new for u in r.uids])
        res.evicted_stale = len(new) - queued_new
        res.accepted = queued_new
        return res

    def lease(self, n: int, lease_s: float, min_weight_version: int | None, now: float | None = None) -> Lease | None:
        """Lease exactly ``n`` queued groups (oldest first), or None and nothing leased."""
        now = time.time() if now is None else now
        self.expire(now)
        if self.n[GroupState.queued] < n:
            return None
        if min_weight_version is None:
            seqs = [r[0] for r in self.db.execute("SELECT seq FROM groups WHERE state=? ORDER BY seq LIMIT ?",
                                                  (GroupState.queued, n))]
        else:
            seqs = [r[0] for r in self.db.execute(
                "SELECT seq FROM groups WHERE state=? AND weight_version>=? ORDER BY seq LIMIT ?",
                (GroupState.queued, min_weight_version, n))]
        if len(seqs) < n:
            return None
        blobs, lost = self.payloads.get(seqs)
        if lost:   # never served: dead-lettered, and the lease is chosen again without them
            self._lost(lost, now)
            return self.lease(n, lease_s, min_weight_version, now)
        lease = Lease(uuid.uuid4().hex, now + lease_s, [blobs[s] for s in seqs])
        with self._txn():
            self.db.execute("INSERT INTO leases(lease_id, state, expires_at, n) VALUES (?, ?, ?, ?)",
                            (lease.lease_id, LeaseState.active, lease.expires_at, n))
            for marks, c in chunks(seqs):
                self.db.execute(f"UPDATE groups SET state=?, lease_id=? WHERE seq IN ({marks})",
                                (GroupState.leased, lease.lease_id, *c))
        self._move(GroupState.queued, GroupState.leased, n)
        self.active[lease.lease_id] = lease.expires_at
        return lease

    def _lost(self, seqs: list[int], now: float) -> None:
        """Dead-letter queued groups whose payload is missing or damaged (``Payloads.get``)."""
        why = "payload lost: its bytes are missing or fail their checksum (an OS crash, or a damaged file)"
        with self._txn():
            self.db.executemany("INSERT INTO dead_letters(seq, group_id, lease_id, reason, at) SELECT seq, group_id, "
                                "'', ?, ? FROM groups WHERE seq=?", [(why, now, s) for s in seqs])
            self.db.executemany("UPDATE groups SET state=? WHERE seq=?", [(GroupState.dead_lettered, s) for s in seqs])
            self.payloads.delete(seqs)
        self._move(GroupState.queued, GroupState.dead_lettered, len(seqs))

    def _settle(self, lease_id: str, action: str, now: float | None) -> int:
        now = time.time() if now is None else now
        self.expire(now)
        row = self.db.execute("SELECT state, expires_at FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
        if row is None:
            raise LeaseNotFound(f"unknown lease {lease_id!r}")
        changes, new_state = lease_transition(LeaseState(row[0]), action, now > row[1])
        if not changes:
            return 0
        with self._txn():
            self.db.execute("UPDATE leases SET state=? WHERE lease_id=?", (new_state, lease_id))
            dst = GroupState.consumed if action == "ack" else GroupState.queued
            if action == "ack":
                self.db.execute("INSERT OR IGNORE INTO purge(seq) SELECT seq FROM groups WHERE lease_id=? AND state=?",
                                (lease_id, GroupState.leased))
                self.to_purge = True
            cur = self.db.execute("UPDATE groups SET state=?, lease_id=NULL WHERE lease_id=? AND state=?",
                                  (dst, lease_id, GroupState.leased))
            stale = self._evict_stale() if dst == GroupState.queued else 0
        self._move(GroupState.leased, dst, cur.rowcount)
        self._move(GroupState.queued, GroupState.evicted, stale)
        self.active.pop(lease_id, None)
        self.held.pop(lease_id, None)
        return cur.rowcount

    def ack(self, lease_id: str, now: float | None = None) -> int:
        """Consume the lease's groups (durable). 0 if already acked. LeaseNotFound / LeaseConflict."""
        return self._settle(lease_id, "ack", now)

    def release(self, lease_id: str, now: float | None = None) -> int:
        """Queue the lease's groups again. 0 if already released. LeaseNotFound / LeaseConflict."""
        return self._settle(lease_id, "release", now)

    @property
    def n_held(self) -> int:
        return sum(self.held.values())

    def _active_lease(self, lease_id: str, action: str, now: float) -> tuple[bool, LeaseState]:
        self.expire(now)
        row = self.db.execute("SELECT state, expires_at FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
        if row is None:
            raise LeaseNotFound(f"unknown lease {lease_id!r}")
        return lease_transition(LeaseState(row[0]), action, now > row[1])

    def extend(self, lease_id: str, lease_s: float, trained: bool = False, now: float | None = None) -> tuple[float, bool]:
        """New deadline ``now + lease_s`` (durable); ``trained`` marks the lease held (for good).
        ``(expires_at, held)``. LeaseNotFound; LeaseConflict unless the lease is active."""
        now = time.time() if now is None else now
        self._active_lease(lease_id, "extend", now)
        expires_at = now + lease_s
        held = trained or lease_id in self.held
        with self._txn():
            self.db.execute("UPDATE leases SET expires_at=?, held=? WHERE lease_id=?", (expires_at, int(held), lease_id))
        n = self.db.execute("SELECT n FROM leases WHERE lease_id=?", (lease_id,)).fetchone()[0]
        self.active[lease_id] = expires_at
        if held:
            self.held[lease_id] = n
        return expires_at, held

    def reject(self, lease_id: str, group_ids: list[str], reason: str, now: float | None = None) -> tuple[int, int]:
        """Dead-letter ``group_ids`` of an active lease and queue its other groups: ``(dead, requeued)``.

        A repeat (the same groups, already dead-lettered from this lease) is ``(0, 0)``; other groups
        after a reject are a LeaseConflict. NotInLease when a group is not the lease's;
        LeaseNotFound / LeaseConflict as for ack."""
        now = time.time() if now is None else now
        wanted = list(dict.fromkeys(group_ids))
        changes, _ = self._active_lease(lease_id, "reject", now)
        if not changes:
            done = {r[0] for r in self.db.execute("SELECT group_id FROM dead_letters WHERE lease_id=?", (lease_id,))}
            if not set(wanted) <= done:
                raise LeaseConflict(f"lease {lease_id!r} was already rejected with other groups")
            return 0, 0
        mine = dict(self.db.execute("SELECT group_id, seq FROM groups WHERE lease_id=? AND state=?",
                                    (lease_id, GroupState.leased)))
        foreign = [g for g in wanted if g not in mine]
        if foreign:
            shown = ", ".join(repr(g[:64]) for g in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise NotInLease(f"group_ids: {len(foreign)} not in lease {lease_id!r}: {shown}")
        with self._txn():
            self.db.execute("UPDATE leases SET state=? WHERE lease_id=?", (LeaseState.rejected, lease_id))
            self.db.executemany("INSERT INTO dead_letters(seq, group_id, lease_id, reason, at) VALUES (?, ?, ?, ?, ?)",
                                [(mine[g], g, lease_id, reason, now) for g in wanted])
            self.db.executemany("UPDATE groups SET state=?, lease_id=NULL WHERE seq=?",
                                [(GroupState.dead_lettered, mine[g]) for g in wanted])
            self.payloads.keep([mine[g] for g in wanted])   # kept for good: in SQLite, not holding a segment
            cur = self.db.execute("UPDATE groups SET state=?, lease_id=NULL WHERE lease_id=? AND state=?",
                                  (GroupState.queued, lease_id, GroupState.leased))
            stale = self._evict_stale()
        self._move(GroupState.leased, GroupState.dead_lettered, len(wanted))
        self._move(GroupState.leased, GroupState.queued, cur.rowcount)
        self._move(GroupState.queued, GroupState.evicted, stale)
        self.active.pop(lease_id, None)
        self.held.pop(lease_id, None)
        return len(wanted), cur.rowcount

    def dead_letters(self, after: int = 0, limit: int = 100) -> tuple[list[dict[str, object]], int | None]:
        """Dead-lettered groups with id > ``after``, oldest first: ``(page, next cursor or None)``."""
        rows = self.db.execute("SELECT id, group_id, lease_id, reason, at FROM dead_letters WHERE id>? ORDER BY id LIMIT ?",
                               (after, limit + 1)).fetchall()
        page = [{"id": r[0], "group_id": r[1], "lease_id": r[2], "reason": r[3], "at": r[4]} for r in rows[:limit]]
        return page, (rows[limit - 1][0] if len(rows) > limit else None)

    def next_expiry(self) -> float | None:
        return min(self.active.values()) if self.active else None

    def expire(self, now: float | None = None) -> int:
        """Return the groups of every lapsed lease to the queue; the number of groups returned."""
        now = time.time() if now is None else now
        due = [lid for lid, t in self.active.items() if t < now]
        if not due:
            return 0
        returned = 0
        with self._txn():
            for lid in due:
                self.db.execute("UPDATE leases SET state=? WHERE lease_id=?", (LeaseState.expired, lid))
                cur = self.db.execute("UPDATE groups SET state=?, lease_id=NULL WHERE lease_id=? AND state=?",
                                      (GroupState.queued, lid, GroupState.leased))
                returned += cur.rowcount
            stale = self._evict_stale()
        for lid in due:
            del self.active[lid]
            self.held.pop(lid, None)
        self._move(GroupState.leased, GroupState.queued, returned)
        self._move(GroupState.queued, GroupState.evicted, stale)
        return returned

    def set_policy_version(self, version: int) -> int:
        """Record the trainer's version and evict queued groups now stale; the number evicted."""
        with self._txn():
            self.counters["policy_version"] = version
            stale = self._evict_stale()
            self._save_counters()
        self._move(GroupState.queued, GroupState.evicted, stale)
        return stale

    def _evict_stale(self) -> int:
        """Inside a transaction: mark every queued group stale for the recorded policy version
        evicted (its blob to be purged); the number marked. Called wherever groups join the queue
        again (a lease released, expired or partly rejected) as well as when the version moves, so
        the queue never holds a group the trainer's lease floor would skip: such groups counted as
        backlog and could stop admission for good."""
        cutoff = stale_cutoff(self.counters["policy_version"], self.max_staleness)
        self.db.execute("INSERT OR IGNORE INTO purge(seq) SELECT seq FROM groups WHERE state=? AND weight_version<?",
                        (GroupState.queued, cutoff))
        cur = self.db.execute("UPDATE groups SET state=? WHERE state=? AND weight_version<?",
                              (GroupState.evicted, GroupState.queued, cutoff))
        self.to_purge = self.to_purge or cur.rowcount > 0
        return cur.rowcount

    def purge(self, limit: int = 256) -> int:
        """Delete up to ``limit`` blobs of consumed or evicted groups; the number deleted."""
        if not self.to_purge:
            return 0
        seqs = [r[0] for r in self.db.execute("SELECT seq FROM purge LIMIT ?", (min(limit, MAX_VARS),))]
        if not seqs:
            self.to_purge = False
            return 0
        marks = ",".join("?" * len(seqs))
        with self._txn():
            self.payloads.delete(seqs)
            self.db.execute(f"DELETE FROM purge WHERE seq IN ({marks})", seqs)
        return len(seqs)

    def count(self, key: str, k: int = 1) -> None:
        """Bump an in-memory counter (rejected, throttled); persisted with the next write."""
        self.counters[key] += k

    def stats(self) -> dict[str, int]:
        return {
            "queued": self.n[GroupState.queued],
            "leased": self.n[GroupState.leased],
            "held": self.n_held,
            "consumed": self.n[GroupState.consumed],
            "dead_lettered": self.n[GroupState.dead_lettered],
            "evicted_stale": self.n[GroupState.evicted],
            "duplicates": self.counters["duplicates"],
            "rejected": self.counters["rejected"],
            "throttled": self.counters["throttled"],
            "policy_version": self.counters["policy_version"],
            "capacity": self.capacity,
        }

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.stop()
        self.payloads.close()
        try:
            with self._txn():
                self._save_counters()
        finally:
            self.db.close()
