"""The admission rule of continuous rollout (``shared.staleness.admits``): for one service it is the
plain ``backlog + in flight < cap``; for k services sharing a buffer (``rollout.data.shard``) their
admissions together never put more than the cap ahead of the trainer, and each still generates."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.shared.staleness import admission_cap, admission_share, admits


def test_one_service_keeps_the_plain_rule() -> None:
    for cap in range(1, 9):
        for backlog in range(12):
            for in_flight in range(12):
                assert admits(backlog, in_flight, cap) == (backlog + in_flight < cap)


def test_shares_split_the_cap() -> None:
    assert [admission_share(8, i, 3) for i in range(3)] == [3, 3, 2]
    assert [admission_share(2, i, 3) for i in range(3)] == [1, 1, 1]   # every service may generate
    assert sum(admission_share(admission_cap(1, 16), i, 5) for i in range(5)) == 32


def _fill(backlog: int, in_flight: list[int], cap: int) -> list[int]:
    """Every service admits groups while the rule lets it, in turns."""
    k, moved = len(in_flight), True
    while moved:
        moved = False
        for i in range(k):
            if admits(backlog, in_flight[i], cap, i, k):
                in_flight[i] += 1
                moved = True
    return in_flight


def test_services_pushing_at_the_same_pace_stay_within_the_cap() -> None:
    for cap, k in ((8, 2), (32, 4), (12, 3), (16, 5)):
        backlog, in_flight = 0, _fill(0, [0] * k, cap)
        for _ in range(20):
            assert backlog + sum(in_flight) <= cap
            pushed = [f // 2 for f in in_flight]       # every service lands half of its groups
            backlog += sum(pushed)
            in_flight = _fill(backlog, [f - p for f, p in zip(in_flight, pushed)], cap)
            backlog = max(0, backlog - cap // 2)       # the trainer leases a step
        assert backlog + sum(in_flight) <= cap


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(1, 64), k=st.integers(1, 9),
       events=st.lists(st.tuples(st.sampled_from(["admit", "push", "lease"]), st.integers(0, 8)), max_size=200))
def test_services_in_any_order_stay_below_twice_the_cap(cap: int, k: int, events: list[tuple[str, int]]) -> None:
    """Admissions, pushes by any service and leases in any order: the total ahead of the trainer
    stays below twice the cap (k x cap when each service admitted against the whole cap)."""
    backlog, in_flight = 0, [0] * k
    for what, who in events:
        i = who % k
        if what == "admit" and admits(backlog, in_flight[i], cap, i, k):
            in_flight[i] += 1
        elif what == "push" and in_flight[i]:
            in_flight[i] -= 1
            backlog += 1
        elif what == "lease":
            backlog = max(0, backlog - max(1, cap // 2))
        assert backlog + sum(in_flight) < 2 * max(cap, k)
        assert all(f <= admission_share(cap, j, k) for j, f in enumerate(in_flight))
        if k == 1:
            assert backlog + in_flight[0] <= cap
