"""Rank 0's calls to the buffer, made to outlive a buffer restart, and the keeper of its leases.

- ``retrying(what, call, ...)``: a call that gets no answer (connection refused or reset, timeout)
  or a 5xx / 429 is tried again with exponential backoff (0.5 s doubling, at most 10 s apart), each
  retry logged, for at most ``BUFFER_OUTAGE_S`` seconds in all (``STOP_OUTAGE_S`` once a stop was
  requested, so SIGTERM is not held up by a dead buffer); then the last ``BufferError`` is raised.
  Any other 4xx is raised at once. Every call retried here is idempotent on the buffer (lease,
  ack, release, extend, reject, policy version), except that a lease whose answer was lost in
  transit holds its groups until its deadline (``buffer.lease_s``) — nobody trains them twice.
- ``expired(err)``: the buffer no longer knows the lease as ours (409: expired or settled; 404:
  unknown). Its groups are back in the queue: they will be leased and trained again.
- ``LeaseKeeper``: a daemon thread that extends every lease rank 0 has — the one being trained
  (``trained: false``) and the held ones (trained, not yet in a checkpoint: ``trained: true``) —
  every ``lease_s / 3`` seconds, so neither a long step nor a long wait between checkpoints lets
  them expire. It has its own HTTP client (the main thread's is not shared across threads). A
  lease the buffer answers 409/404 for is dropped and logged as replayed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable

from headrace.shared.client import BufferClient, BufferError

log = logging.getLogger("headrace.trainer")

BUFFER_OUTAGE_S = 300.0   # longest a trainer waits for an unreachable buffer (a restart takes seconds)
STOP_OUTAGE_S = 5.0       # the same once SIGTERM was received
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.5, 10.0


def transient(err: BufferError) -> bool:
    """No answer, a 5xx or a 429: the buffer may be restarting or busy; try again."""
    return err.status == 0 or err.status == 429 or err.status >= 500


def expired(err: BufferError) -> bool:
    """409/404 on a lease: the buffer holds it for us no longer (expired, settled or unknown)."""
    return err.status in (404, 409)


def retrying(what: str, call: Callable[..., Any], *args: Any, stopping: Callable[[], bool] = lambda: False,
             **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, retried through a buffer outage (see the module docstring)."""
    t0 = time.monotonic()
    delay = _FIRST_BACKOFF_S
    attempt = 0
    while True:
        try:
            return call(*args, **kwargs)
        except BufferError as e:
            if not transient(e):
                raise
            waited = time.monotonic() - t0
            budget = STOP_OUTAGE_S if stopping() else BUFFER_OUTAGE_S
            if waited + delay > budget:
                log.error("buffer %s: giving up after %.0fs and %d attempts: %s", what, waited, attempt + 1, e)
                raise
            attempt += 1
            log.warning("buffer %s failed (%s); retry %d in %.1fs (%.0fs of at most %.0fs so far)",
                        what, e, attempt, delay, waited, budget)
            time.sleep(delay * (0.75 + random.random() / 2))
            delay = min(_MAX_BACKOFF_S, delay * 2)


class LeaseKeeper:
    """Extends rank 0's leases in the background (see the module docstring)."""

    def __init__(self, url: str, token: str | None, lease_s: float) -> None:
        self.url, self.token, self.lease_s = url, token, lease_s
        self.interval = max(0.2, lease_s / 3)
        self._leases: dict[str, bool] = {}      # lease id -> trained (held)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def track(self, lease_id: str, trained: bool) -> None:
        with self._lock:
            self._leases[lease_id] = trained
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="lease-keeper")
                self._thread.start()

    def forget(self, lease_id: str) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def tracked(self, lease_id: str) -> bool:
        with self._lock:
            return lease_id in self._leases

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self) -> None:
        with BufferClient(self.url, token=self.token, retries=0, timeout=10.0) as client:
            while not self._wake.wait(self.interval) and not self._closed:
                self.extend_all(client)

    def extend_all(self, client: Any) -> None:
        """One round: extend every tracked lease (one failure does not stop the others)."""
        with self._lock:
            leases = dict(self._leases)
        for lease_id, trained in leases.items():
            try:
                client.extend_lease(lease_id, self.lease_s, trained=trained)
            except BufferError as e:
                if expired(e) and self.tracked(lease_id):   # not acked or released meanwhile
                    self.forget(lease_id)
                    log.warning("lease %s expired before %s (%s): its groups are back in the queue and will be "
                                "trained again", lease_id, "its checkpoint" if trained else "its step ended", e)
                elif not expired(e):
                    log.warning("extending lease %s failed (%s); trying again in %.0fs", lease_id, e, self.interval)
