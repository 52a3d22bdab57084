"""Property: random invalid bodies never crash the buffer and never store anything.

Three families of bodies, JSON or msgpack: random bytes, random JSON-like values, and valid
requests with one invariant broken (a mutation known to be invalid). Each must be answered 422;
afterwards the server is alive and nothing was queued or counted as duplicate.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import msgpack
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.buffer.support import make_group, start_buffer, stats

_ids = itertools.count()


@pytest.fixture(scope="module")
def fuzz_buf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    d = tmp_path_factory.mktemp("fuzz")
    proc, url = start_buffer(d, "--db", str(d / "f.sqlite"))
    yield proc, url
    proc.stop()


def _sample_mutation(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(s: dict[str, Any]) -> None:
        s[field] = value(s) if callable(value) else value
    return apply


SAMPLE_MUTATIONS: list[Callable[[dict[str, Any]], None]] = [
    _sample_mutation("tokens", "not a list"),
    _sample_mutation("tokens", lambda s: s["tokens"][:-1] + [-1]),
    _sample_mutation("tokens", lambda s: s["tokens"][:-1] + [1.5]),
    _sample_mutation("response_length", -1),
    _sample_mutation("response_length", lambda s: len(s["tokens"]) + 1),
    _sample_mutation("loss_mask", lambda s: s["loss_mask"] + [1]),
    _sample_mutation("loss_mask", lambda s: [2] * len(s["loss_mask"])),
    _sample_mutation("rollout_logprobs", lambda s: [0.5] * len(s["loss_mask"])),
    _sample_mutation("rollout_logprobs", lambda s: s["rollout_logprobs"][1:]),
    _sample_mutation("reward", None),
    _sample_mutation("reward", float("nan")),  # msgpack keeps NaN; orjson writes it as null: both invalid
    _sample_mutation("reward", float("-inf")),
    _sample_mutation("reward", "high"),
    _sample_mutation("status", "bogus"),
    _sample_mutation("weight_version", -1),
    _sample_mutation("index", -3),
    _sample_mutation("uid", ""),
    _sample_mutation("group_id", "someone-else"),
    _sample_mutation("unexpected", 1),
    lambda s: s.pop("uid"),
    lambda s: s.pop("tokens"),
]


def _group_mutations() -> list[Callable[[dict[str, Any]], None]]:
    def dup_index(g: dict[str, Any]) -> None:
        g["samples"][1]["index"] = g["samples"][0]["index"]

    def dup_uid(g: dict[str, Any]) -> None:
        g["samples"][1]["uid"] = g["samples"][0]["uid"]

    def empty(g: dict[str, Any]) -> None:
        g["samples"] = []

    def no_id(g: dict[str, Any]) -> None:
        g.pop("group_id")

    def meta_list(g: dict[str, Any]) -> None:
        g["metadata"] = [1, 2]

    return [dup_index, dup_uid, empty, no_id, meta_list]


GROUP_MUTATIONS = _group_mutations()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["groups", "samples", "x"]) | st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def invalid_bodies(draw: st.DrawFn) -> tuple[bytes, str]:
    use_msgpack = draw(st.booleans())
    kind = draw(st.sampled_from(["bytes", "value", "mutated"]))
    if kind == "bytes":
        body = draw(st.binary(min_size=0, max_size=200))
    else:
        if kind == "value":
            obj: Any = draw(json_values)
        else:
            n = draw(st.integers(1, 3))
            groups = [make_group(f"fz{next(_ids)}", n=2) for _ in range(n)]
            target = groups[draw(st.integers(0, n - 1))]
            if draw(st.booleans()):
                draw(st.sampled_from(GROUP_MUTATIONS))(target)
            else:
                draw(st.sampled_from(SAMPLE_MUTATIONS))(target["samples"][draw(st.integers(0, 1))])
            obj = {"groups": copy.deepcopy(groups)}
        body = msgpack.packb(obj) if use_msgpack else orjson.dumps(obj)
    return body, ("application/msgpack" if use_msgpack else "application/json")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=invalid_bodies())
def test_invalid_bodies_are_refused_and_store_nothing(fuzz_buf: tuple[Any, str], case: tuple[bytes, str]) -> None:
    proc, url = fuzz_buf
    body, ctype = case
    r = httpx.post(url + "/v1/groups", content=body, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == 422, (r.status_code, r.text, body[:200])
    assert isinstance(r.json()["detail"], str) and r.json()["detail"]
    assert proc.alive()


def test_after_fuzzing_nothing_was_stored(fuzz_buf: tuple[Any, str]) -> None:
    proc, url = fuzz_buf
    assert httpx.get(url + "/health").status_code == 200 and proc.alive()
    s = stats(url)
    assert s["queued"] == 0 and s["leased"] == 0 and s["duplicates"] == 0 and s["evicted_stale"] == 0
    assert s["rejected"] >= 1
    # and the service still stores a valid group
    assert httpx.post(url + "/v1/groups", json={"groups": [make_group("after-fuzz")]}).json()["accepted"] == 1
    assert "Traceback" not in proc.log()
