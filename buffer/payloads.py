"""Where the buffer's store keeps group payloads: append-only segment files beside a file-backed
database, or SQLite's ``blobs`` table in memory.

Why files: SQLite copies a blob into its pages twice (the WAL at the commit, the database at a
checkpoint), ~0.9 ms of the store's single thread per MB, and makes the WAL ~1.6x the payload.
A segment takes the bytes once, in one ``pwritev`` that runs without the GIL.

Guarantees (``Payloads(db, path, sync)``; the store calls it on its one thread):
- ``put`` runs inside the store's transaction, before its COMMIT: it appends the blobs to the
  current segment (``<db>.blobs/NNNNNNNN.seg``) and records one ref (segment, offset, length,
  crc32) per blob in the ``payloads`` table of that transaction. With ``sync``
  (``buffer.durability: power_loss``) the segment is fdatasync'ed before ``put`` returns, so a
  commit never outlives its bytes. Without it (``process_crash``) the bytes are in the OS's
  cache when ``put`` returns, which a kill -9 of the buffer does not lose.
- Bytes of a transaction that rolled back, or that a crash cut off before the commit, are never
  referenced: wasted space until their segment is deleted.
- ``get`` answers the bytes of each ref whose length and crc32 match and names the others lost.
  An OS crash under ``process_crash`` can keep a commit whose bytes never reached the disk, and
  a file can be removed by hand; the store dead-letters such groups instead of serving garbage.
- Only the process that created a segment appends to it: every open starts a new one, and a
  segment is closed past ``SEGMENT_BYTES`` (one bigger request makes one bigger segment).
- A segment file is deleted once no committed ref points to it and it is not being written:
  right after the commit that deleted its last refs (``delete``, then ``settle``), and at open
  (files a crash left behind). Up to ``_SPARES`` of them are renamed ``*.spare`` instead and
  written again as later segments (overwriting pages the OS holds costs half of growing a new
  file); old bytes past what a segment wrote are never referenced. A group
  leased for long (a held lease) keeps its whole segment on disk meanwhile.
- ``Transaction`` is the store's only way to commit: it settles the ref counts after each
  transaction (a failed COMMIT counts its new refs, never its deletions).
- Rows of the ``blobs`` table (databases written before segments; the in-memory store, which
  has no directory; dead letters, moved there by ``keep`` so that one kept group does not hold a
  whole segment) are read and deleted as before.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

try:   # the same CRC-32 as zlib's (the same values on disk), ~9x faster here: 0.016 against 0.14 ms per MB
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels
    from zlib import crc32

if TYPE_CHECKING:
    from headrace.buffer.checkpointer import WalCheckpointer

T = TypeVar("T")

SEGMENT_BYTES = 64 << 20
_SPARES = 2   # freed segment files kept for reuse
_IOV = 1024   # buffers per pwritev (IOV_MAX on Linux)
MAX_VARS = 900  # stay below SQLite's bound-parameter limit on old builds
SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (seq INTEGER PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS payloads (seq INTEGER PRIMARY KEY, segment INTEGER NOT NULL, offset INTEGER NOT NULL,
                                     length INTEGER NOT NULL, crc INTEGER NOT NULL);
"""


def chunks(values: list[T]) -> list[tuple[str, list[T]]]:
    """``values`` in slices SQLite can bind at once, each with its ``?,?,...`` marks."""
    return [(",".join("?" * len(c)), c) for c in (values[i:i + MAX_VARS] for i in range(0, len(values), MAX_VARS))]


class Payloads:
    """The payload store of one ``Store`` (see the module docstring)."""

    def __init__(self, db: sqlite3.Connection, path: str | None, sync: bool) -> None:
        self.db = db
        self.sync = sync
        self.dir = Path(f"{path}.blobs") if path else None
        self.refs: dict[int, int] = {}      # segment -> committed refs
        self._pending: dict[int, int] = {}  # segment -> refs added (+) / deleted (-) by the open transaction
        self._readers: dict[int, int] = {}  # segment -> fd opened for reading
        self.seg, self.end, self.fd = 0, 0, -1
        self.spares: list[Path] = []   # freed segment files, renamed, to be written again
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.refs = dict(db.execute("SELECT segment, COUNT(*) FROM payloads GROUP BY segment"))
        on_disk = {int(p.stem) for p in self.dir.glob("*.seg") if p.stem.isdigit()}
        self.seg = max(on_disk | set(self.refs), default=0)   # the next put starts segment seg + 1
        for i, spare in enumerate(sorted(self.dir.glob("*.spare"))):
            if i < _SPARES:
                self.spares.append(spare)
            else:
                spare.unlink()
        for s in on_disk - set(self.refs):
            self._drop(s)

    def put(self, items: list[tuple[int, bytes]]) -> None:
        """Store ``(seq, blob)`` pairs; inside the caller's transaction."""
        if not items:
            return
        if self.dir is None:
            self.db.executemany("INSERT INTO blobs(seq, data) VALUES (?, ?)", items)
            return
        size = sum(len(b) for _, b in items)
        if self.fd < 0 or (self.end and self.end + size > SEGMENT_BYTES):
            self._next_segment()
        rows, off = [], self.end
        for seq, b in items:
            rows.append((seq, self.seg, off, len(b), crc32(b)))
            off += len(b)
        pos = self.end
        for i in range(0, len(items), _IOV):
            bufs = [b for _, b in items[i:i + _IOV]]
            want = sum(len(b) for b in bufs)
            if os.pwritev(self.fd, bufs, pos) != want:
                raise OSError(f"{self.dir}: short write to segment {self.seg}")
            pos += want
        self.end = off
        if self.sync:
            os.fdatasync(self.fd)
        self.db.executemany("INSERT INTO payloads(seq, segment, offset, length, crc) VALUES (?, ?, ?, ?, ?)", rows)
        self._pending[self.seg] = self._pending.get(self.seg, 0) + len(rows)

    def get(self, seqs: list[int]) -> tuple[dict[int, bytes], list[int]]:
        """The stored bytes of ``seqs`` and, in their order, the seqs whose bytes are missing or damaged."""
        found: dict[int, bytes] = {}
        for marks, c in chunks(seqs):
            found.update(self.db.execute(f"SELECT seq, data FROM blobs WHERE seq IN ({marks})", c))
            if self.dir is None:
                continue
            for seq, seg, off, n, crc in self.db.execute(
                    f"SELECT seq, segment, offset, length, crc FROM payloads WHERE seq IN ({marks})", c).fetchall():
                try:
                    b = os.pread(self._reader(seg), n, off)
                except OSError:
                    continue
                if len(b) == n and crc32(b) == crc:
                    found[seq] = b
        return found, [s for s in seqs if s not in found]

    def delete(self, seqs: list[int]) -> None:
        """Drop the payloads of ``seqs``; inside the caller's transaction (``settle`` frees files)."""
        for marks, c in chunks(seqs):
            self.db.execute(f"DELETE FROM blobs WHERE seq IN ({marks})", c)
        self._unref(seqs)

    def keep(self, seqs: list[int]) -> None:
        """Move the payloads of ``seqs`` into the ``blobs`` table, for groups kept for good (dead
        letters), so that they hold no segment on disk; damaged ones are dropped. Inside the
        caller's transaction."""
        if self.dir is None:
            return
        found, _ = self.get(seqs)
        self.db.executemany("INSERT OR REPLACE INTO blobs(seq, data) VALUES (?, ?)", list(found.items()))
        self._unref(seqs)

    def _unref(self, seqs: list[int]) -> None:
        if self.dir is None:
            return
        for marks, c in chunks(seqs):
            for seg, k in self.db.execute(f"SELECT segment, COUNT(*) FROM payloads WHERE seq IN ({marks}) "
                                          "GROUP BY segment", c).fetchall():
                self._pending[seg] = self._pending.get(seg, 0) - k
            self.db.execute(f"DELETE FROM payloads WHERE seq IN ({marks})", c)

    def settle(self, committed: bool | None) -> None:
        """After the transaction: its ref counts take effect (committed) or are forgotten (rolled
        back); ``None`` (a COMMIT that failed, so maybe committed): only its new refs count, so a
        file is never deleted while a ref may point to it. Segments left without refs, other than
        the one being written, are deleted."""
        pending, self._pending = self._pending, {}
        if committed is None:
            pending = {seg: k for seg, k in pending.items() if k > 0}
        elif not committed:
            return
        for seg, k in pending.items():
            left = self.refs.get(seg, 0) + k
            if left > 0:
                self.refs[seg] = left
                continue
            self.refs.pop(seg, None)
            if seg != self.seg:
                self._drop(seg)

    def close(self) -> None:
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- helpers ---------------------------------------------------------------------------

    def _file(self, seg: int) -> Path:
        assert self.dir is not None
        return self.dir / f"{seg:08d}.seg"

    def _next_segment(self) -> None:
        old = self.seg
        if self.fd >= 0:
            os.close(self.fd)
            if old not in self.refs and not self._pending.get(old):
                self._drop(old)
        self.seg, self.end = old + 1, 0
        new = self._file(self.seg)
        if self.spares:   # overwriting pages the OS holds costs half of growing a new file
            os.rename(self.spares.pop(), new)
        self.fd = os.open(new, os.O_WRONLY | os.O_CREAT, 0o600)
        if self.sync:   # the new file's name survives a power loss too
            d = os.open(self.dir, os.O_RDONLY)   # type: ignore[arg-type]
            try:
                os.fsync(d)
            finally:
                os.close(d)

    def _reader(self, seg: int) -> int:
        fd = self._readers.get(seg)
        if fd is None:
            fd = self._readers[seg] = os.open(self._file(seg), os.O_RDONLY)
        return fd

    def _drop(self, seg: int) -> None:
        fd = self._readers.pop(seg, None)
        if fd is not None:
            os.close(fd)
        f = self._file(seg)
        if len(self.spares) < _SPARES and f.exists():
            spare = f.with_suffix(".spare")
            os.rename(f, spare)
            self.spares.append(spare)
        else:
            f.unlink(missing_ok=True)


class Transaction:
    """The store's BEGIN IMMEDIATE ... COMMIT, rolled back on error, with the payloads' ref counts
    settled after it (``Payloads.settle``) and, between two transactions, the WAL's RESTART when
    the checkpointer asks for one (``buffer.checkpointer``)."""

    def __init__(self, db: sqlite3.Connection, payloads: Payloads, checkpointer: "WalCheckpointer | None") -> None:
        self.db = db
        self.payloads = payloads
        self.checkpointer = checkpointer

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
            except BaseException:
                self.payloads.settle(committed=None)   # it may have committed: count its new refs
                raise
            self.payloads.settle(committed=True)
            if self.checkpointer is not None and self.checkpointer.restart_due:
                self.checkpointer.restart(self.db)   # between two transactions (buffer.checkpointer)
        else:
            self.payloads.settle(committed=False)
            self.db.execute("ROLLBACK")
