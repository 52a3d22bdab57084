"""WAL checkpoints off the request path, for the buffer's file store (``buffer.store``).

SQLite checkpoints a WAL database inside whichever commit crosses ``wal_autocheckpoint`` pages: it
copies the WAL into the database file and syncs it there and then. Under ingest that was 2/3 of
the store's commit time on this machine (1 MB posts: 3.0 s in all vs 1.0 s without it, single
commits up to 371 ms), paid by the post or the ack that happened to commit at that moment. The
store turns automatic checkpoints off and runs this thread instead.

Guarantees:
- Durability is unchanged: a commit is as durable in the WAL as before (``synchronous`` per
  ``buffer.durability``); a checkpoint only copies committed frames into the database file, and a
  crash at any point of one loses nothing (SQLite replays the WAL at the next open).
- This thread's checkpoints are PASSIVE, on its own connection: they never wait for, nor block,
  the store's reads and writes (which run on the store's thread meanwhile: sqlite3 releases the
  GIL). Only the RESTART below runs on the store's thread, and delays that thread's next request.
- The WAL stays bounded, under writes that never pause too: every ``interval_s`` the thread
  checkpoints what was committed; once all of it is in the database file the next writer starts
  the WAL from its beginning again, and ``journal_size_limit`` (set by the store) truncates the
  file then. But commits that come closer together than a checkpoint takes keep it from ever
  catching up (it copies the frames present when it starts), and SQLite never starts the WAL over:
  4 producers posting 1 MB bodies without pause grew it to 700 MB in 10 s; one thread committing
  256 KB in a loop made no reset in 33,000 commits. So once the WAL holds more than
  ``restart_bytes``, the thread syncs the database file and checkpoints what came meanwhile (no
  lock held; ``_catch_up``), then sets ``restart_due``; the store, the only writer, runs a RESTART
  checkpoint between two of its transactions (``restart``), which copies and syncs the frames
  committed since, and its next commit starts the WAL over. Taking the writer's lock from this
  thread instead starved: SQLite's busy handler sleeps, and a busy writer takes the lock first.
- ``stop`` ends the thread (the store's ``close`` calls it before closing its own connection, whose
  close checkpoints the rest).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

log = logging.getLogger("headrace.buffer")

__all__ = ["WalCheckpointer"]


class WalCheckpointer:
    """A daemon thread running ``PRAGMA wal_checkpoint(PASSIVE)`` on ``path`` every ``interval_s``;
    ``restart_due`` once the WAL outgrows ``restart_bytes`` (the store restarts it and clears it)."""

    def __init__(self, path: str, interval_s: float = 0.5, restart_bytes: int = 64 << 20) -> None:
        self.path = path
        self.interval_s = interval_s
        self.restart_bytes = restart_bytes
        self.checkpoints = 0           # completed PASSIVE checkpoints that copied frames
        self.restart_due = False       # set here; ``restart`` (on the store's thread) clears it
        self.restarts = 0              # RESTART checkpoints that completed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="buffer-wal-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as e:   # the store works on without it: SQLite checkpoints at close
            log.warning("WAL checkpointer for %s not started: %s", self.path, e)
            return
        try:
            page = db.execute("PRAGMA page_size").fetchone()[0]
            while not self._stop.wait(self.interval_s):
                if self.restart_due:
                    continue   # the store's RESTART is next; a PASSIVE now would only hold it up
                got = self.checkpoint(db)
                if got is not None and got[1] * page > self.restart_bytes:
                    self._catch_up(db, page, got[1])
                    self.restart_due = True
        finally:
            db.close()

    def checkpoint(self, db: sqlite3.Connection) -> tuple[int, int, int] | None:
        """One PASSIVE checkpoint: SQLite's (busy, frames in the WAL, frames checkpointed), or None."""
        try:
            busy, frames, done = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as e:   # e.g. the file was removed under a stopped store: try again later
            log.debug("WAL checkpoint of %s failed: %s", self.path, e)
            return None
        if done > 0:
            self.checkpoints += 1
        return busy, frames, done

    def restart(self, db: sqlite3.Connection) -> bool:
        """On the store's thread, between two of its transactions, on its connection (the only
        writer): ``wal_checkpoint(RESTART)``, so that its next commit starts the WAL over. True when
        it completed; a failure leaves the last commit as it was, and the thread asks again."""
        try:
            busy, _, _ = db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
        except sqlite3.Error as e:
            log.warning("WAL restart of %s failed: %s", self.path, e)
            busy = 1
        self.restart_due = False
        self.restarts += not busy
        return not busy

    def _catch_up(self, db: sqlite3.Connection, page: int, frames: int, rounds: int = 3) -> None:
        """Before asking for the RESTART: sync the database file (what the PASSIVE checkpoints
        copied) and checkpoint what arrived meanwhile, again while that was much, so that the
        store's RESTART has little left to copy and sync while it holds up the store's writes.
        ``frames``: the WAL's frames at the last checkpoint."""
        for _ in range(rounds):
            self._sync_database()
            got = self.checkpoint(db)   # its WAL sync and copy cover the frames that came during ours
            if got is None or (got[1] - frames) * page < self.restart_bytes // 8:
                break
            frames = got[1]
        self._sync_database()

    def _sync_database(self) -> None:
        """fsync the database file, no lock held."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            log.debug("sync of %s failed: %s", self.path, e)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
