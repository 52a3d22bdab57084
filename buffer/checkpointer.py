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
- Checkpoints are PASSIVE, on this thread's own connection: they never wait for, nor block, the
  store's reads and writes (which run on the store's thread meanwhile: sqlite3 releases the GIL).
- The WAL stays bounded: every ``interval_s`` the thread checkpoints what was committed; once all
  of it is in the database file the next writer starts the WAL from its beginning again, and
  ``journal_size_limit`` (set by the store) truncates the file then.
- ``stop`` ends the thread (the store's ``close`` calls it before closing its own connection, whose
  close checkpoints the rest).
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("headrace.buffer")

__all__ = ["WalCheckpointer"]


class WalCheckpointer:
    """A daemon thread running ``PRAGMA wal_checkpoint(PASSIVE)`` on ``path`` every ``interval_s``."""

    def __init__(self, path: str, interval_s: float = 0.5) -> None:
        self.path = path
        self.interval_s = interval_s
        self.checkpoints = 0           # completed PASSIVE checkpoints that copied frames
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
            while not self._stop.wait(self.interval_s):
                self.checkpoint(db)
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

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
