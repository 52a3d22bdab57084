"""The columnar wire format on a real `headrace buffer serve` (loopback, SQLite file, run token).

POST /v1/groups takes columns; leases answer in columns when asked, whatever form the groups
arrived in, and in JSON / msgpack rows for groups that arrived as columns; bad columns are one 422
naming the group and field with nothing stored; the clients use columns by default; columns
survive a kill -9 like rows.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgpack
import numpy as np
import pytest

from headrace.shared import columns as C
from headrace.shared.client import AsyncBufferClient, BufferClient, BufferError, LeaseColumns
from tests.buffer.support import make_group, start_buffer

TOKEN = "columns-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def buf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    d = tmp_path_factory.mktemp("bufcols")
    (d / "token").write_text(TOKEN)
    proc, url = start_buffer(d, "--db", str(d / "b.sqlite"), "--token-file", str(d / "token"))
    yield url, d
    assert proc.alive(), proc.log()
    proc.stop()


def stats(url: str) -> dict[str, int]:
    return httpx.get(url + "/v1/stats", headers=AUTH, timeout=10).json()


def post_columns(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/groups", content=body, timeout=30,
                      headers={**AUTH, "content-type": C.COLUMNS, **(headers or {})})


def lease(url: str, n: int, accept: str) -> httpx.Response:
    return httpx.post(url + "/v1/leases", json={"groups": n}, headers={**AUTH, "accept": accept}, timeout=30)


def ack(url: str, lease_id: str) -> None:
    assert httpx.post(f"{url}/v1/leases/{lease_id}/ack", headers=AUTH, timeout=10).status_code == 200


def drain(url: str) -> None:
    q = stats(url)["queued"]
    if q:
        r = lease(url, q, "application/json")
        ack(url, r.json()["lease_id"])


def full(g: dict[str, Any]) -> dict[str, Any]:
    """``make_group``'s dict with every field, as a lease answers it."""
    d = {"response": None, "metadata": {}}
    return {**g, "samples": [{**d, **s} for s in g["samples"]]}


def test_columns_in_every_form_out(buf: tuple[str, Path]) -> None:
    url, _ = buf
    drain(url)
    assert post_columns(url, C.encode([make_group("c0")]), {"authorization": "Bearer wrong"}).status_code == 401
    cgroups = [make_group(f"c{i}", n=3) for i in range(3)]
    rgroups = [make_group(f"r{i}") for i in range(2)]
    r = post_columns(url, C.encode(cgroups))
    assert r.status_code == 200 and r.json() == {"accepted": 3, "duplicates": 0, "evicted_stale": 0}
    assert post_columns(url, C.encode(cgroups[:1])).json()["duplicates"] == 1  # dedupe as rows
    assert httpx.post(url + "/v1/groups", json={"groups": rgroups}, headers=AUTH).status_code == 200
    want = [full(g) for g in cgroups + rgroups]

    got = lease(url, 5, C.COLUMNS)  # column blobs and row blobs, one columnar answer
    assert got.status_code == 200 and got.headers["content-type"] == C.COLUMNS
    cols, top = C.decode(got.content, ("lease_id", "expires_at"))
    assert cols.to_rows() == want and set(top) == {"lease_id", "expires_at"}
    assert httpx.post(f"{url}/v1/leases/{top['lease_id']}/release", headers=AUTH).status_code == 200

    want = [full(g) for g in cgroups] + rgroups  # row blobs are answered as they were sent
    js = lease(url, 5, "application/json")  # column blobs answered as JSON rows
    assert js.headers["content-type"] == "application/json" and js.json()["groups"] == want
    httpx.post(f"{url}/v1/leases/{js.json()['lease_id']}/release", headers=AUTH)
    mp = lease(url, 5, "application/msgpack")
    assert msgpack.unpackb(mp.content)["groups"] == want
    ack(url, msgpack.unpackb(mp.content)["lease_id"])
    assert stats(url)["consumed"] >= 5 and stats(url)["queued"] == 0


BAD: list[tuple[str, Any, str]] = [
    ("mismatched lengths", lambda m: m["samples"]["status"].pop(), "samples.status: 3 entries for 4 samples"),
    ("offsets out of range", lambda m: m["samples"].__setitem__(
        "token_offsets", np.array([0, 7, 14, 21, 99], "<i8").tobytes()), "samples.token_offsets: offsets must"),
    ("offsets decreasing", lambda m: m["groups"].__setitem__(
        "sample_offsets", np.array([0, 3, 2, 4], "<i8").tobytes()), "groups.sample_offsets: offsets must"),
    ("wrong dtype", lambda m: m["samples"].__setitem__("tokens", list(range(28))), "samples.tokens: must be bin"),
    ("byte length", lambda m: m["samples"].__setitem__("rollout_logprobs", b"\0" * 6),
     "samples.rollout_logprobs: byte length 6 is not a multiple of the item size 4"),
    ("NaN logprob", lambda m: _poke(m, "rollout_logprobs", "<f4", 13, np.nan),
     "groups[2].samples[1].rollout_logprobs[1]: Input should be a finite number"),
    ("positive logprob", lambda m: _poke(m, "rollout_logprobs", "<f4", 13, 0.5),
     "groups[2].samples[1].rollout_logprobs: rollout_logprobs must be <= 0 (found 0.5)"),
    ("mask 3", lambda m: _poke(m, "loss_mask", "u1", 4, 3), "groups[1].samples[0].loss_mask: loss_mask values must"),
]


def _poke(m: dict[str, Any], key: str, dtype: str, i: int, value: Any) -> None:
    a = np.frombuffer(m["samples"][key], dtype).copy()
    a[i] = value
    m["samples"][key] = a.tobytes()


@pytest.mark.parametrize("name,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_columns_are_422_and_store_nothing(buf: tuple[str, Path], name: str, change: Any, message: str) -> None:
    url, _ = buf
    groups = [make_group(f"bad-{name}-{i}", n=1 if i < 2 else 2) for i in range(3)]  # 4 samples, 4 responses each
    m = msgpack.unpackb(C.encode(groups), raw=False)
    change(m)
    before = stats(url)
    r = post_columns(url, msgpack.packb(m, use_bin_type=True))
    assert r.status_code == 422 and r.json()["detail"].startswith(message), r.json()
    after = stats(url)
    assert after["queued"] == before["queued"] and after["rejected"] == before["rejected"] + 3
    # nothing was stored: the same groups, fixed, are new
    assert post_columns(url, C.encode(groups)).json()["accepted"] == 3


def test_large_column_bodies_take_the_worker_thread_alike(buf: tuple[str, Path]) -> None:
    """A column body over ``INLINE_PARSE_BYTES`` is checked on a worker thread instead of the event
    loop: the same 422 (nothing stored), the same acceptance."""
    from headrace.buffer.app import INLINE_PARSE_BYTES

    url, _ = buf
    drain(url)
    groups = [make_group(f"big-{i}", n=8, prompt=16, response=20_000) for i in range(4)]
    body = C.encode(groups)
    assert len(body) > INLINE_PARSE_BYTES
    m = msgpack.unpackb(body, raw=False)
    _poke(m, "rollout_logprobs", "<f4", 3 * 8 * 20_000 + 5, np.nan)
    before = stats(url)
    r = post_columns(url, msgpack.packb(m, use_bin_type=True))
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("groups[3].samples[0].rollout_logprobs[5]: Input should be a finite number")
    assert stats(url)["queued"] == before["queued"] and stats(url)["rejected"] == before["rejected"] + 4
    r = post_columns(url, body)
    assert r.status_code == 200 and r.json()["accepted"] == 4
    got = lease(url, 4, C.COLUMNS)
    cols, top = C.decode(got.content, ("lease_id", "expires_at"))
    assert cols.to_rows() == [full(g) for g in groups]
    ack(url, top["lease_id"])


def test_lease_request_is_not_columns(buf: tuple[str, Path]) -> None:
    url, _ = buf
    r = httpx.post(url + "/v1/leases", content=C.encode([make_group("x")]), headers={**AUTH, "content-type": C.COLUMNS})
    assert r.status_code == 415
    r = httpx.post(url + "/v1/groups", content=b"x", headers={**AUTH, "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["detail"].endswith(f"or {C.COLUMNS}")


def test_clients_use_columns_by_default(buf: tuple[str, Path]) -> None:
    url, _ = buf
    drain(url)
    groups = [make_group(f"cl{i}", n=2) for i in range(4)]
    with BufferClient(url, token=TOKEN) as c:
        assert c.columns and c.post_groups(groups).accepted == 4
        got = c.lease_columns(2)
        assert isinstance(got, LeaseColumns) and got.columns.to_rows() == [full(g) for g in groups[:2]]
        c.ack(got.lease_id)
        models = c.lease(2)  # Group models built from the validated columns
        assert [g.model_dump(mode="json") for g in models.groups] == [full(g) for g in groups[2:]]
        c.ack(models.lease_id)
        bad = make_group("cl-bad")
        bad["samples"][0]["tokens"][0] = 2.5  # columns cannot carry it: sent as rows, the row schema names it
        with pytest.raises(BufferError) as e:
            c.post_groups([bad])
        assert e.value.status == 422 and e.value.message.startswith("groups[0].samples[0].tokens[0]")

    async def run() -> list[dict[str, Any]]:
        async with AsyncBufferClient(url, token=TOKEN) as a:
            assert (await a.post_groups([make_group("acl")])).accepted == 1
            got = await a.lease_columns(1)
            await a.ack(got.lease_id)
            return got.columns.to_rows()

    assert asyncio.run(run()) == [full(make_group("acl"))]


def test_columns_survive_kill9(tmp_path: Path) -> None:
    db = tmp_path / "b.sqlite"
    proc, url = start_buffer(tmp_path, "--db", str(db), name="before")
    groups = [make_group(f"k{i}", n=3) for i in range(3)]
    try:
        assert httpx.post(url + "/v1/groups", content=C.encode(groups), headers={"content-type": C.COLUMNS}).json()[
            "accepted"] == 3
        proc.kill9()
    finally:
        proc.stop()
    proc, url = start_buffer(tmp_path, "--db", str(db), name="after")
    try:
        r = httpx.post(url + "/v1/leases", json={"groups": 3}, headers={"accept": C.COLUMNS})
        assert C.decode(r.content, ("lease_id", "expires_at"))[0].to_rows() == [full(g) for g in groups]
    finally:
        proc.stop()
