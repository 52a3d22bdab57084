"""The buffer's rules, as pure functions: staleness, lease states and backpressure hints.

Kept apart from SQL (store.py) and HTTP (app.py) so each rule is stated once:
- a group is stale when ``weight_version < policy_version - max_staleness`` (strictly less;
  ``headrace.shared.staleness`` states it for every service);
- a lease is active until acked, released, rejected or expired; only an active lease may be
  acked, released, rejected or extended, except that repeating the same ack (or release, or
  reject) is a no-op answered 200;
- when full, clients are told to come back after ``retry_after_s`` seconds.
"""

from __future__ import annotations

import math
from enum import IntEnum


class GroupState(IntEnum):
    queued = 0
    leased = 1
    consumed = 2
    evicted = 3
    dead_lettered = 4


class LeaseState(IntEnum):
    active = 0
    acked = 1
    released = 2
    expired = 3
    rejected = 4


class LeaseNotFound(LookupError):
    """No lease has this id (HTTP 404)."""


class LeaseConflict(RuntimeError):
    """The lease is not active any more (expired, or acked/released the other way) (HTTP 409)."""


class NotInLease(ValueError):
    """A reject names groups the lease does not hold (HTTP 422)."""


class BufferFull(RuntimeError):
    """Storing the request would exceed the capacity (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_s(overflow: int, capacity: int) -> int:
    """Seconds a refused producer should wait: 1 s, more when the request overflows by a lot.

    The buffer drains at the trainer's pace, which it does not know; one second keeps a producer
    close behind the trainer without spinning, and a request far beyond capacity waits longer.
    """
    return max(1, min(30, math.ceil(overflow / max(1, capacity) * 10)))


def lease_transition(state: LeaseState, action: str, expired_by_time: bool) -> tuple[bool, LeaseState]:
    """``(changes_anything, new_state)`` for ``action`` ("ack" | "release" | "reject" | "extend").

    Raises ``LeaseConflict`` when the action is not allowed: the lease expired, or it was already
    settled the other way (ack after release, release after ack).
    """
    target = {"ack": LeaseState.acked, "release": LeaseState.released, "reject": LeaseState.rejected,
              "extend": LeaseState.active}[action]
    if state == LeaseState.active and not expired_by_time:
        return True, target
    if state == target and action != "extend":
        return False, state
    if state == LeaseState.expired or (state == LeaseState.active and expired_by_time):
        raise LeaseConflict(f"lease expired; its groups went back to the queue ({action} refused)")
    raise LeaseConflict(f"lease was already {state.name}; cannot {action} it")
