"""The admission rule of continuous rollout (``shared.staleness.admits``): for one service it is the
plain ``backlog + in flight < cap``; for k services sharing a buffer (``rollout.data.shard``, with
or without ``weights``) their admissions together never put more than the cap ahead of the trainer
while they push in proportion to their shares, never twice the cap in any order, and each still
generates."""

from __future__ import annotations

import pytest
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


def test_weighted_shares_follow_the_weights() -> None:
    assert [admission_share(8, i, 2, [2, 1]) for i in range(2)] == [5, 3]     # 5.33 / 2.67: the larger remainder
    assert [admission_share(8, i, 3, [1, 1, 1]) for i in range(3)] == [3, 3, 2]
    assert [admission_share(3, i, 4, [100, 1, 1, 1]) for i in range(4)] == [3, 1, 1, 1]   # cap < services
    # six shares round to 0 or 1 and the large one to 2: one unit moves so that each gets 1
    assert [admission_share(7, i, 7, [1, 1, 1, 1, 1, 1, 3]) for i in range(7)] == [1] * 7
    with pytest.raises(ValueError, match="need 2 positive integers"):
        admission_share(8, 0, 2, [1, 1, 1])
    with pytest.raises(ValueError, match="need 2 positive integers"):
        admission_share(8, 0, 2, [1, 0])


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(1, 300), weights=st.lists(st.integers(1, 50), min_size=1, max_size=12))
def test_weighted_shares_sum_to_the_cap_and_round_within_one(cap: int, weights: list[int]) -> None:
    k, total = len(weights), sum(weights)
    shares = [admission_share(cap, i, k, weights) for i in range(k)]
    assert min(shares) >= 1
    assert sum(shares) == cap if cap >= k else sum(shares) <= cap + k
    if all(cap * w >= total for w in weights):     # no share rounded to 0 (and raised to 1)
        assert all(abs(s - cap * w / total) < 1 for s, w in zip(shares, weights))
    assert [admission_share(cap, i, k, [weights[0]] * k) for i in range(k)] == \
        [admission_share(cap, i, k) for i in range(k)]         # equal weights: the even split


def _fill(backlog: int, in_flight: list[int], cap: int, weights: list[int] | None = None) -> list[int]:
    """Every service admits groups while the rule lets it, in turns."""
    k, moved = len(in_flight), True
    while moved:
        moved = False
        for i in range(k):
            if admits(backlog, in_flight[i], cap, i, k, weights):
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


def test_weighted_services_pushing_in_proportion_stay_within_the_cap() -> None:
    """A service with three times the engines pushes three times as fast: with weights [3, 1] it
    fills three quarters of the cap and together they stay within it; with even shares the larger
    one would sit at half the cap while the smaller one's half stays idle."""
    for cap, weights in ((8, [3, 1]), (32, [4, 2, 1, 1]), (12, [5, 1, 1])):
        k = len(weights)
        backlog, in_flight = 0, _fill(0, [0] * k, cap, weights)
        assert in_flight == [admission_share(cap, i, k, weights) for i in range(k)]
        for _ in range(20):
            assert backlog + sum(in_flight) <= cap
            pushed = [f // 2 for f in in_flight]
            backlog += sum(pushed)
            in_flight = _fill(backlog, [f - p for f, p in zip(in_flight, pushed)], cap, weights)
            backlog = max(0, backlog - cap // 2)
        assert backlog + sum(in_flight) <= cap


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(1, 64), k=st.integers(1, 9), weighted=st.booleans(), data=st.data(),
       events=st.lists(st.tuples(st.sampled_from(["admit", "push", "lease"]), st.integers(0, 8)), max_size=200))
def test_services_in_any_order_stay_below_twice_the_cap(cap: int, k: int, weighted: bool, data: st.DataObject,
                                                        events: list[tuple[str, int]]) -> None:
    """Admissions, pushes by any service and leases in any order: the total ahead of the trainer
    stays below the cap plus the shares, twice the cap when it is at least k (k x cap when each
    service admitted against the whole cap)."""
    weights = data.draw(st.lists(st.integers(1, 9), min_size=k, max_size=k)) if weighted else None
    shares = [admission_share(cap, j, k, weights) for j in range(k)]
    backlog, in_flight = 0, [0] * k
    for what, who in events:
        i = who % k
        if what == "admit" and admits(backlog, in_flight[i], cap, i, k, weights):
            in_flight[i] += 1
        elif what == "push" and in_flight[i]:
            in_flight[i] -= 1
            backlog += 1
        elif what == "lease":
            backlog = max(0, backlog - max(1, cap // 2))
        assert backlog + sum(in_flight) < cap + sum(shares)
        assert weighted or backlog + sum(in_flight) < 2 * max(cap, k)
        assert cap < k or sum(shares) == cap
        assert all(f <= s for f, s in zip(in_flight, shares))
        if k == 1:
            assert backlog + in_flight[0] <= cap
