"""Adversarial input against a real `headrace buffer serve` (DESIGN "Trust": strict validation).

Every case sends one bad request and checks: a 4xx whose detail names the problem, the process
alive, and nothing stored or changed (stats equal before and after, but for the ``rejected``
counter). Cases are grouped in classes (the id's prefix, before ``-``): lax types for every
integer and float field, extreme ids and values, nesting, msgpack extension types and non-string
keys, oversized / malformed / mistyped bodies, unknown fields, bad lease, extend, reject,
policy-version and dead-letter requests, made-up methods. The inputs that used to poison a group
(a Timestamp, a bytes key, a label 300 deep) are then checked not to: a JSON lease and a msgpack
lease of the next group both answer 200.
"""

from __future__ import annotations

import copy
import sqlite3
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import msgpack
import orjson
import pytest

from tests.buffer.support import make_group, start_buffer, stats

JSON, MSGPACK = "application/json", "application/msgpack"
MAX_MB = 1
_DEEP = "__deep__"


@pytest.fixture(scope="module")
def adv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A buffer with a 1 MiB body limit and one standing lease (2 groups) that no case may disturb."""
    d = tmp_path_factory.mktemp("adv")
    proc, url = start_buffer(d, "--db", str(d / "a.sqlite"), "--max-body-mb", str(MAX_MB))
    assert httpx.post(url + "/v1/groups", json={"groups": [make_group("stand0"), make_group("stand1")]}).status_code == 200
    standing = httpx.post(url + "/v1/leases", json={"groups": 2, "lease_s": 3600}).json()
    yield {"url": url, "proc": proc, "lease": standing["lease_id"]}
    assert proc.alive(), proc.log()
    r = httpx.post(f"{url}/v1/leases/{standing['lease_id']}/ack")
    assert r.status_code == 200 and r.json()["groups"] == 2  # the standing lease was never disturbed
    assert "Traceback" not in proc.log(), proc.log()[-3000:]
    proc.stop()


def _encode(obj: Any, fmt: str) -> tuple[bytes, str]:
    if fmt == "m":
        return msgpack.packb(obj, use_bin_type=True), MSGPACK
    body = orjson.dumps(obj)
    if _DEEP.encode() in body:  # orjson cannot write 300 levels: splice them in as text
        body = body.replace(f'"{_DEEP}"'.encode(), b"[" * 300 + b"1" + b"]" * 300)
    return body, JSON


def _deep(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


def _group_body(mutate: Callable[[dict[str, Any]], None], fmt: str) -> tuple[bytes, str]:
    g = make_group("adv-victim")
    mutate(g)
    return _encode({"groups": [make_group("adv-innocent"), g]}, fmt)


def _sample(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def m(g: dict[str, Any]) -> None:
        g["samples"][1][field] = copy.deepcopy(value)
    return m


def _item(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def m(g: dict[str, Any]) -> None:
        g["samples"][1][field][0] = value
    return m


def _group(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def m(g: dict[str, Any]) -> None:
        g[field] = value
    return m


S1 = "groups[1].samples[1]"
# (id, mutation of the victim group, expected text in the 422's detail, body formats)
GROUP_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = []
for _field in ("index", "response_length", "weight_version"):
    for _name, _bad in (("str", "1"), ("bool", True), ("float", 1.0)):
        GROUP_CASES.append((f"laxint-{_field}-{_name}", _sample(_field, _bad), f"{S1}.{_field}", "jm"))
for _field in ("tokens", "loss_mask"):
    for _name, _bad in (("str", "1"), ("bool", True), ("float", 1.0)):
        GROUP_CASES.append((f"laxint-{_field}-item-{_name}", _item(_field, _bad), f"{S1}.{_field}", "jm"))
GROUP_CASES += [
    ("laxfloat-reward-str", _sample("reward", "1.0"), f"{S1}.reward", "jm"),
    ("laxfloat-reward-bool", _sample("reward", True), f"{S1}.reward", "jm"),
    ("laxfloat-logprob-str", _item("rollout_logprobs", "-0.5"), f"{S1}.rollout_logprobs", "jm"),
    ("laxfloat-logprob-bool", _item("rollout_logprobs", False), f"{S1}.rollout_logprobs", "jm"),
    ("laxfloat-reward-inf", _sample("reward", float("inf")), f"{S1}.reward", "m"),
    ("laxstr-uid-bytes", _sample("uid", b"adv-victim/1"), f"{S1}.uid", "m"),
    ("laxstr-prompt-int", _sample("prompt", 7), f"{S1}.prompt", "jm"),
    ("laxstr-status-bool", _sample("status", True), f"{S1}.status", "jm"),
    ("tokenid-2^31", _item("tokens", 2**31), f"{S1}.tokens", "jm"),
    ("tokenid-2^64-1", _item("tokens", 2**64 - 1), f"{S1}.tokens", "jm"),
    ("tokenid-2^64-json-float", _item("tokens", 2**64 - 1), f"{S1}.tokens", "j"),  # see _huge below
    ("tokenid-negative", _item("tokens", -1), f"{S1}.tokens", "jm"),
    ("extreme-weight-version-2^63", _sample("weight_version", 2**63), f"{S1}.weight_version", "jm"),
    ("extreme-index-2^64-1", _sample("index", 2**64 - 1), f"{S1}.index", "m"),
    ("extreme-group-id-513", lambda g: g.update(group_id="g" * 513), "groups[1].group_id", "jm"),
    ("extreme-uid-empty", _sample("uid", ""), f"{S1}.uid", "jm"),
    ("extreme-group-too-large", lambda g: g.update(samples=[dict(g["samples"][0], index=i, uid=f"u{i}")
                                                           for i in range(1025)]), "groups[1].samples", "m"),
    ("nesting-label-300", _sample("label", _DEEP), f"{S1}.label", "j"),
    ("nesting-label-300-msgpack", _sample("label", _deep(300)), f"{S1}.label", "m"),
    ("nesting-label-33", _sample("label", _deep(33)), "nested deeper than 32", "jm"),
    ("nesting-metadata-40", _sample("metadata", {"a": _deep(40)}), f"{S1}.metadata", "jm"),
    ("nesting-group-metadata-40", _group("metadata", {"a": _deep(40)}), "groups[1].metadata", "jm"),
    ("freeform-int-2^64-1", _sample("label", {"big": 2**64 - 1}), f"{S1}.label", "m"),
    ("ext-timestamp-label", _sample("label", msgpack.Timestamp(1, 0)), f"{S1}.label", "m"),
    ("ext-timestamp-nested", _sample("metadata", {"t": [msgpack.Timestamp(1, 0)]}), f"{S1}.metadata", "m"),
    ("ext-custom-type", _sample("label", msgpack.ExtType(5, b"x")), "extension type 5", "m"),
    ("ext-timestamp-token", _item("tokens", msgpack.Timestamp(1, 0)), f"{S1}.tokens[0]", "m"),
    ("ext-timestamp-prompt", _sample("prompt", msgpack.Timestamp(1, 0)), f"{S1}.prompt", "m"),
    ("key-bytes-metadata", _sample("metadata", {b"k": 1}), f"{S1}.metadata", "m"),
    ("key-bytes-label", _sample("label", {"a": {b"k": 1}}), f"{S1}.label", "m"),
    ("key-bytes-group-metadata", _group("metadata", {b"k": 1}), "groups[1].metadata", "m"),
    ("bin-value-label", _sample("label", b"\x00\xff"), f"{S1}.label", "m"),
    ("unknown-field-sample", _sample("rewardz", 1.0), f"{S1}.rewardz", "jm"),
    ("unknown-field-group", _group("extra", 1), "groups[1].extra", "jm"),
]
GROUP_PARAMS = [pytest.param(m, expect, fmt, id=f"{cid}-{fmt}") for cid, m, expect, fmts in GROUP_CASES for fmt in fmts]


def _check_refused(adv: dict[str, Any], method: str, path: str, body: bytes | None, ctype: str | None,
                   status: int | tuple[int, ...], expect: str, **kw: Any) -> httpx.Response:
    url = adv["url"]
    before = stats(url)
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.request(method, url + path, content=body, headers=headers, timeout=30, **kw)
    assert r.status_code in ((status,) if isinstance(status, int) else status), (r.status_code, r.text[:500])
    detail = r.json()["detail"]
    assert isinstance(detail, str) and expect in detail, detail
    assert adv["proc"].alive()
    after = stats(url)
    before.pop("rejected"), after.pop("rejected")
    assert after == before  # nothing stored, leased, consumed or dead-lettered
    return r


@pytest.mark.parametrize("mutate, expect, fmt", GROUP_PARAMS)
def test_bad_group_is_422_naming_the_field_and_stores_nothing(adv: dict[str, Any], mutate: Any, expect: str,
                                                              fmt: str) -> None:
    body, ctype = _group_body(mutate, fmt)
    if b"18446744073709551615" in body and fmt == "j" and b"tokens" in body:
        body = body.replace(b"18446744073709551615", b"18446744073709551616")  # beyond u64: orjson reads a float
    _check_refused(adv, "POST", "/v1/groups", body, ctype, 422, expect)


BODY_CASES = [  # (id, method, path, body, content-type, status, expected text)
    ("malformed-json-truncated", "POST", "/v1/groups", b'{"groups": [', JSON, 422, "malformed JSON"),
    ("malformed-json-trailing", "POST", "/v1/groups", b'{"groups": []} x', JSON, 422, "malformed JSON"),
    ("malformed-json-nan", "POST", "/v1/leases", b'{"groups": NaN}', JSON, 422, "malformed JSON"),
    ("malformed-json-lone-surrogate", "POST", "/v1/groups", b'{"groups": ["\\ud800"]}', JSON, 422, "malformed JSON"),
    ("malformed-json-deep-100k", "POST", "/v1/groups", b"[" * 100_000 + b"]" * 100_000, JSON, 422, "malformed JSON"),
    ("malformed-msgpack-truncated", "POST", "/v1/groups", msgpack.packb({"groups": [1, 2]})[:-1], MSGPACK, 422,
     "malformed msgpack"),
    ("malformed-msgpack-trailing", "POST", "/v1/leases", msgpack.packb({"groups": 1}) + b"\x01", MSGPACK, 422,
     "malformed msgpack"),
    ("malformed-msgpack-deep-100k", "POST", "/v1/groups", b"\x91" * 100_000 + b"\x01", MSGPACK, 422, "malformed msgpack"),
    ("malformed-msgpack-bad-utf8", "POST", "/v1/leases", b"\x81\xa6groups\xa2\xff\xfe", MSGPACK, 422, "malformed msgpack"),
    ("key-int-msgpack", "POST", "/v1/groups", msgpack.packb({1: 2}), MSGPACK, 422, "malformed msgpack"),
    ("key-bytes-top", "POST", "/v1/leases", msgpack.packb({b"groups": 1}, use_bin_type=True), MSGPACK, 422, "groups"),
    ("ext-timestamp-lease", "POST", "/v1/leases", msgpack.packb({"groups": 1, "lease_s": msgpack.Timestamp(5, 0)}),
     MSGPACK, 422, "lease_s"),
    ("empty-body-groups", "POST", "/v1/groups", b"", JSON, 422, "empty request body"),
    ("empty-body-lease", "POST", "/v1/leases", b"", MSGPACK, 422, "empty request body"),
    ("not-object-groups", "POST", "/v1/groups", b"[1, 2]", JSON, 422, "<body>"),
    ("not-object-policy", "PUT", "/v1/policy_version", b'"7"', JSON, 422, "<body>"),
    ("msgpack-sent-as-json", "POST", "/v1/groups", msgpack.packb({"groups": []}), JSON, 422, "malformed JSON"),
    ("content-type-text", "POST", "/v1/groups", orjson.dumps({"groups": [make_group("ct0")]}), "text/plain", 415,
     "Content-Type"),
    ("content-type-form", "POST", "/v1/leases", b"groups=1", "application/x-www-form-urlencoded", 415, "Content-Type"),
    ("content-type-xml", "PUT", "/v1/policy_version", b"<version>1</version>", "application/xml", 415, "Content-Type"),
    ("unknown-field-top", "POST", "/v1/groups", orjson.dumps({"groups": [make_group("uf0")], "x": 1}), JSON, 422, "x:"),
    ("unknown-field-lease", "POST", "/v1/leases", b'{"groups": 1, "priority": 9}', JSON, 422, "priority"),
    ("unknown-field-policy", "PUT", "/v1/policy_version", b'{"version": 1, "force": true}', JSON, 422, "force"),
    ("no-groups", "POST", "/v1/groups", b'{"groups": []}', JSON, 422, "groups"),
]
for _f, _bad in (("groups", '"1"'), ("groups", "true"), ("groups", "1.0"), ("groups", "0"), ("groups", "-1"),
                 ("groups", "1000001"), ("groups", "18446744073709551615"), ("groups", "1e400"),
                 ("lease_s", "-1"), ("lease_s", "0"), ("lease_s", "604801"), ("lease_s", "1e308"), ("lease_s", '"5"'),
                 ("lease_s", "true"), ("wait_s", "-1"), ("wait_s", "3601"), ("min_weight_version", "-1"),
                 ("min_weight_version", '"3"'), ("min_weight_version", "3.0"), ("min_weight_version", "9223372036854775808")):
    _body = {"groups": "1", f"{_f}": _bad} if _f != "groups" else {"groups": _bad}
    _text = "{" + ", ".join(f'"{k}": {v}' for k, v in _body.items()) + "}"
    _text = _text.replace('"groups": "1", ', '"groups": 1, ') if _f != "groups" else _text
    BODY_CASES.append((f"lease-{_f}-{_bad.strip(chr(34))}", "POST", "/v1/leases", _text.encode(), JSON, 422,
                       "malformed JSON" if _bad == "1e400" else _f))
BODY_CASES.append(("lease-lease_s-inf-msgpack", "POST", "/v1/leases", msgpack.packb({"groups": 1, "lease_s": float("inf")}),
                   MSGPACK, 422, "lease_s"))
BODY_CASES.append(("lease-groups-2^64-1-msgpack", "POST", "/v1/leases", msgpack.packb({"groups": 2**64 - 1}), MSGPACK, 422,
                   "groups"))
for _bad in ('"3"', "true", "3.0", "-1", "9223372036854775808"):
    BODY_CASES.append((f"policy-version-{_bad.strip(chr(34))}", "PUT", "/v1/policy_version",
                       f'{{"version": {_bad}}}'.encode(), JSON, 422, "version"))


@pytest.mark.parametrize("method, path, body, ctype, status, expect",
                         [pytest.param(*c[1:], id=c[0]) for c in BODY_CASES])
def test_bad_body_is_refused_and_changes_nothing(adv: dict[str, Any], method: str, path: str, body: bytes,
                                                  ctype: str, status: int, expect: str) -> None:
    _check_refused(adv, method, path, body, ctype, status, expect)


def _lease_cases() -> list[Any]:
    """Bad extend / reject bodies against the standing lease ("{L}" is its id)."""
    ext, rej = "/v1/leases/{L}/extend", "/v1/leases/{L}/reject"
    cases = [
        ("extend-lease_s-negative", ext, {"lease_s": -5}, "lease_s"),
        ("extend-lease_s-zero", ext, {"lease_s": 0}, "lease_s"),
        ("extend-lease_s-huge", ext, {"lease_s": 1e9}, "lease_s"),
        ("extend-lease_s-str", ext, {"lease_s": "60"}, "lease_s"),
        ("extend-lease_s-bool", ext, {"lease_s": True}, "lease_s"),
        ("extend-lease_s-missing", ext, {"trained": True}, "lease_s"),
        ("extend-trained-str", ext, {"lease_s": 60, "trained": "true"}, "trained"),
        ("extend-trained-int", ext, {"lease_s": 60, "trained": 1}, "trained"),
        ("extend-unknown-field", ext, {"lease_s": 60, "forever": True}, "forever"),
        ("reject-not-in-lease", rej, {"group_ids": ["stand0", "someone-else"], "reason": "x"}, "someone-else"),
        ("reject-empty-ids", rej, {"group_ids": [], "reason": "x"}, "group_ids"),
        ("reject-ids-not-list", rej, {"group_ids": "stand0", "reason": "x"}, "group_ids"),
        ("reject-id-int", rej, {"group_ids": [7], "reason": "x"}, "group_ids[0]"),
        ("reject-id-too-long", rej, {"group_ids": ["g" * 513], "reason": "x"}, "group_ids[0]"),
        ("reject-reason-too-long", rej, {"group_ids": ["stand0"], "reason": "x" * 2001}, "reason"),
        ("reject-reason-empty", rej, {"group_ids": ["stand0"], "reason": ""}, "reason"),
        ("reject-reason-missing", rej, {"group_ids": ["stand0"]}, "reason"),
        ("reject-unknown-field", rej, {"group_ids": ["stand0"], "reason": "x", "requeue": False}, "requeue"),
    ]
    out = [pytest.param(path, body, expect, fmt, id=f"{cid}-{fmt}") for cid, path, body, expect in cases for fmt in "jm"]
    out.append(pytest.param(rej, {"group_ids": ["stand0"], "reason": msgpack.Timestamp(1, 0)}, "reason", "m",
                            id="ext-timestamp-reason-m"))
    return out


@pytest.mark.parametrize("path, obj, expect, fmt", _lease_cases())
def test_bad_extend_or_reject_is_422_and_the_lease_is_untouched(adv: dict[str, Any], path: str, obj: Any,
                                                                 expect: str, fmt: str) -> None:
    body, ctype = _encode(obj, fmt)
    _check_refused(adv, "POST", path.replace("{L}", adv["lease"]), body, ctype, 422, expect)


@pytest.mark.parametrize("path, status, expect", [
    pytest.param("/v1/leases/" + "x" * 4000 + "/ack", 404, "unknown lease", id="extreme-lease-id-4000"),
    pytest.param("/v1/leases/%00%ff/extend", 404, "unknown lease", id="extreme-lease-id-bytes"),
    pytest.param("/v1/leases/nope/reject", 404, "unknown lease", id="unknown-lease-reject"),
    pytest.param("/v1/dead_letters?limit=0", 422, "limit", id="page-limit-zero"),
    pytest.param("/v1/dead_letters?limit=1001", 422, "limit", id="page-limit-huge"),
    pytest.param("/v1/dead_letters?limit=abc", 422, "limit", id="page-limit-str"),
    pytest.param("/v1/dead_letters?after=-1", 422, "after", id="page-after-negative"),
    pytest.param("/v1/dead_letters?after=99999999999999999999", 422, "after", id="page-after-huge"),
    pytest.param("/v1/dead_letters?after=1&after=2", 422, "repeated", id="page-after-repeated"),
    pytest.param("/v1/dead_letters?sort=desc", 422, "sort", id="page-unknown-param"),
])
def test_bad_path_or_query_is_refused(adv: dict[str, Any], path: str, status: int, expect: str) -> None:
    method = "GET" if "dead_letters" in path else "POST"
    body = orjson.dumps({"group_ids": ["a"], "reason": "r"}) if path.endswith("reject") else (
        orjson.dumps({"lease_s": 5}) if path.endswith("extend") else None)
    _check_refused(adv, method, path, body, JSON if body else None, status, expect)


@pytest.mark.parametrize("path, chunked", [("/v1/groups", False), ("/v1/groups", True), ("/v1/leases", False),
                                           ("/v1/leases/{L}/extend", True), ("/v1/leases/{L}/reject", False)])
def test_oversized_body_is_413(adv: dict[str, Any], path: str, chunked: bool) -> None:
    big = b"[" + b" " * (MAX_MB * 1024 * 1024 + 10) + b"]"
    body: Any = (c for c in (big[:1000], big[1000:])) if chunked else big
    _check_refused(adv, "POST", path.replace("{L}", adv["lease"]), body, JSON, 413, "too large" if path != "/v1/groups"
                   else "max-body-mb")


def test_made_up_methods_are_405_and_counted_as_other(adv: dict[str, Any]) -> None:
    url = adv["url"]
    for method, path in (("BREW", "/v1/groups"), ("FOO", "/health"), ("DELETE", "/v1/stats"), ("PATCH", "/v1/leases"),
                         ("XYZZY", "/no/such/path")):
        before = stats(url)
        r = httpx.request(method, url + path, timeout=10)
        assert r.status_code in (404, 405), (method, r.status_code)
        assert adv["proc"].alive() and stats(url) == before
    text = httpx.get(url + "/metrics").text
    series = [line for line in text.splitlines() if line.startswith("headrace_buffer_request_seconds_count")]
    assert any('method="other"' in line for line in series), series
    for made_up in ("BREW", "FOO", "DELETE", "PATCH", "XYZZY", "/no/such/path"):
        assert made_up not in text
    assert {line.split('method="')[1].split('"')[0] for line in series} <= {"GET", "HEAD", "POST", "PUT", "other"}


@pytest.mark.parametrize("poison", [
    pytest.param(_sample("label", msgpack.Timestamp(1, 0)), id="timestamp"),
    pytest.param(_sample("metadata", {b"k": 1}), id="bytes-key"),
    pytest.param(_sample("label", _deep(300)), id="label-300-deep"),
])
def test_formerly_poisoning_inputs_leave_leases_working(adv: dict[str, Any], poison: Any) -> None:
    url = adv["url"]
    body, ctype = _group_body(poison, "m")
    assert httpx.post(url + "/v1/groups", content=body, headers={"content-type": ctype}).status_code == 422
    gid = f"after-{id(poison)}"
    assert httpx.post(url + "/v1/groups", json={"groups": [make_group(gid)]}).json()["accepted"] == 1
    r = httpx.post(url + "/v1/leases", json={"groups": 1, "lease_s": 60})
    assert r.status_code == 200 and r.json()["groups"][0]["group_id"] == gid
    assert httpx.post(f"{url}/v1/leases/{r.json()['lease_id']}/release").status_code == 200
    r = httpx.post(url + "/v1/leases", content=msgpack.packb({"groups": 1, "lease_s": 60}),
                   headers={"content-type": MSGPACK, "accept": MSGPACK})
    assert r.status_code == 200
    got = msgpack.unpackb(r.content)
    assert got["groups"][0]["group_id"] == gid
    assert httpx.post(f"{url}/v1/leases/{got['lease_id']}/ack").status_code == 200


def test_free_form_at_the_bound_is_accepted_and_leases_both_ways(adv: dict[str, Any]) -> None:
    """The nesting bound is the one documented: 32 levels are stored and answered as JSON and msgpack."""
    url = adv["url"]
    g = make_group("bound32")
    g["samples"][0]["label"] = _deep(31)
    g["samples"][1]["metadata"] = {"n": 2**63 - 1, "neg": -(2**63), "f": 1.5, "t": [True, None, "s"]}
    body, ctype = _encode({"groups": [g]}, "m")
    assert httpx.post(url + "/v1/groups", content=body, headers={"content-type": ctype}).json()["accepted"] == 1
    r = httpx.post(url + "/v1/leases", json={"groups": 1})
    assert r.status_code == 200 and r.json()["groups"][0]["samples"][0]["label"] == _deep(31)
    assert httpx.post(f"{url}/v1/leases/{r.json()['lease_id']}/release").status_code == 200
    r = httpx.post(url + "/v1/leases", json={"groups": 1}, headers={"accept": MSGPACK})
    assert r.status_code == 200 and msgpack.unpackb(r.content)["groups"][0]["samples"][1]["metadata"]["n"] == 2**63 - 1
    assert httpx.post(f"{url}/v1/leases/{msgpack.unpackb(r.content)['lease_id']}/ack").status_code == 200


def test_a_stored_group_that_cannot_be_answered_is_released_not_locked(tmp_path: Path) -> None:
    """Defence in depth: validation keeps such a blob out, so plant one in the database by hand."""
    db = tmp_path / "planted.sqlite"
    proc, url = start_buffer(tmp_path, "--db", str(db), name="plant1")
    proc.stop()
    con = sqlite3.connect(db)
    seq = con.execute("INSERT INTO groups(group_id, weight_version, state) VALUES ('planted', 0, 0)").lastrowid
    con.execute("INSERT INTO blobs(seq, data) VALUES (?, ?)",
                (seq, msgpack.packb({"group_id": "planted", "samples": [], "t": msgpack.Timestamp(1, 0)})))
    con.commit()
    con.close()
    proc, url = start_buffer(tmp_path, "--db", str(db), name="plant2")
    try:
        r = httpx.post(url + "/v1/leases", json={"groups": 1})
        assert r.status_code == 500 and "released" in r.json()["detail"]
        s = stats(url)
        assert (s["queued"], s["leased"]) == (1, 0)  # not locked until expiry
        r = httpx.post(url + "/v1/leases", json={"groups": 1}, headers={"accept": MSGPACK})
        assert r.status_code == 200  # msgpack answers splice the stored bytes
        assert httpx.post(f"{url}/v1/leases/{msgpack.unpackb(r.content, timestamp=3)['lease_id']}/ack").status_code == 200
        assert proc.alive()
    finally:
        proc.stop()
