"""The staleness rule, stated once for every service.

A group generated with weights of version ``w`` may train a policy at version ``v`` only while
``w >= v - max_staleness``. The buffer evicts groups below that cutoff, the trainer leases with it
as its floor, and the rollout service keeps at most ``max_staleness + 1`` steps of groups ahead of
the trainer (more could only go stale before they are trained).
"""

from __future__ import annotations


def stale_cutoff(policy_version: int, max_staleness: int) -> int:
    """Groups with ``weight_version`` strictly below this are stale (may be negative early on)."""
    return policy_version - max_staleness


def is_stale(weight_version: int, policy_version: int, max_staleness: int) -> bool:
    return weight_version < stale_cutoff(policy_version, max_staleness)


def lease_floor(policy_version: int, max_staleness: int) -> int:
    """The oldest weight version a trainer at ``policy_version`` may lease (never below 0)."""
    return max(0, stale_cutoff(policy_version, max_staleness))


def admission_cap(max_staleness: int, groups_per_step: int) -> int:
    """Groups the rollout service may have in flight or queued ahead of the trainer: one step's
    worth for each version that is not yet stale."""
    return (max_staleness + 1) * groups_per_step
