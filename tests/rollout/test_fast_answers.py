"""``rollout.fast_answers``: batch answers read with simdjson give exactly what orjson and
``answers.check_answer`` give, or nothing (the caller then takes that path).

The bodies are real JSON bytes as engines write them (orjson, and the stdlib's spaced form with
its NaN literals); the transport test serves them over real HTTP on loopback (an aiohttp server in
the test) to the real ``Transport``. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import orjson
import pytest
from aiohttp import web
from hypothesis import event, given, settings
from hypothesis import strategies as st

from headrace.rollout import fast_answers
from headrace.rollout.answers import Answer, Retryable, check_answer, entries_of, logprobs_of
from headrace.rollout.transport import Transport, _fast_batch
from tests.procs import free_port

pytestmark = pytest.mark.skipif(not fast_answers.available(), reason="pysimdjson has no wheel for this platform")


def answer(seed: int, n: int, finish: Any = None, **meta: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150_000, n).tolist()
    lps = (-rng.exponential(1.0, n)).tolist()
    return {"text": f"t{seed} é \"null\" [1]] \\n", "output_ids": ids, "meta_info": {
        "id": f"r{seed}", "finish_reason": finish or {"type": "length", "length": n}, "prompt_tokens": 7,
        "cached_tokens": None, "weight_version": "3", **meta,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}


def fast(body: bytes, n: int, url: str) -> list[Answer] | None:
    """What the transport makes of a batch body on the fast path (any size)."""
    return _fast_batch(body, n, 0)


def slow(body: bytes) -> list[Answer]:
    return [check_answer(o, "http://e") for o in orjson.loads(body)]


def same(fast: list[Answer], body: bytes) -> None:
    ref = slow(body)
    assert len(fast) == len(ref)
    for a, b in zip(fast, ref):
        meta = dict(b["meta_info"])
        del meta["output_token_logprobs"]
        assert (a["text"], a["output_ids"], a["meta_info"]) == (b["text"], b["output_ids"], meta)
        assert {k: v for k, v in a.items() if k not in ("output_ids", "meta_info")} == \
            {k: v for k, v in b.items() if k not in ("output_ids", "meta_info")}
        assert a.entries is None and "output_token_logprobs" not in a["meta_info"]
        assert logprobs_of(a) == logprobs_of(b)
        if a["output_ids"]:
            assert a.arrays is not None and a.arrays[0].tolist() == b["output_ids"]
            assert a.arrays[1].tolist() == logprobs_of(b) and a.arrays[1].flags.c_contiguous
        assert entries_of(a) == b["meta_info"]["output_token_logprobs"]   # built on demand, then kept
        assert a.entries is a["meta_info"]["output_token_logprobs"] and logprobs_of(a) == logprobs_of(b)


@pytest.mark.parametrize("lengths", [[2048] * 8, [1, 300, 0, 5], [129] * 3, [0]])
def test_batches_read_to_the_same_answers(lengths: list[int]) -> None:
    outs = [answer(i, n, finish=("stop" if i % 2 else None), matched=[1, {"x": None}]) for i, n in enumerate(lengths)]
    body = orjson.dumps(outs)
    got = fast(body, len(outs), "http://e")
    assert got is not None
    same(got, body)
    assert got[0]["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_logprobs_of_zero_read_alike() -> None:
    outs = [answer(i, 300) for i in range(2)]
    _set_lp(outs, 0.0)
    outs[0]["meta_info"]["output_token_logprobs"][7][0] = -0.0
    body = orjson.dumps(outs)
    got = fast(body, 2, "http://e")
    assert got is not None and logprobs_of(got[1])[3] == 0.0
    same(got, body)


def _set_lp(outs: list[dict], value: Any) -> None:
    outs[1]["meta_info"]["output_token_logprobs"][3][0] = value


@pytest.mark.parametrize("change", [
    lambda o: _set_lp(o, None), lambda o: _set_lp(o, float("nan")), lambda o: _set_lp(o, 7e99),
    lambda o: _set_lp(o, 5e-7), lambda o: _set_lp(o, 0.5), lambda o: _set_lp(o, "x"),
    lambda o: o[1]["meta_info"]["output_token_logprobs"][3].__setitem__(2, 0),
    lambda o: _set_lp(o, [-0.1]), lambda o: o[1]["meta_info"]["output_token_logprobs"][3].__setitem__(1, 99),
    lambda o: o[1]["meta_info"]["output_token_logprobs"][3].__setitem__(2, "tok"),
    lambda o: o[1]["meta_info"]["output_token_logprobs"][3].append(None),
    lambda o: o[1]["meta_info"]["output_token_logprobs"].pop(),
    lambda o: o[1]["output_ids"].__setitem__(0, 2**31), lambda o: o[1]["output_ids"].__setitem__(0, -1),
    lambda o: o[1]["output_ids"].__setitem__(0, 2.0), lambda o: o[1]["output_ids"].__setitem__(0, [5]),
    lambda o: o[1]["meta_info"].__setitem__("finish_reason", "eos"),
    lambda o: o[1]["meta_info"].pop("finish_reason"), lambda o: o[1].pop("output_ids"),
    lambda o: o[1]["meta_info"].pop("output_token_logprobs"), lambda o: o.pop(),
])
def test_anything_unusual_goes_to_the_orjson_path(change: Any) -> None:
    outs = [answer(i, 40) for i in range(3)]
    change(outs)
    for body in (orjson.dumps(outs), json.dumps(outs).encode()):   # orjson writes NaN as null, json as NaN
        assert fast(body, 3, "http://e") is None


def test_spaced_json_goes_to_the_orjson_path_or_reads_alike_never_a_null_as_zero() -> None:
    outs = [answer(i, 50) for i in range(2)]
    for sep in ((", ", ": "), (",", ": "), (", ", ":")):
        body = json.dumps(outs, separators=sep).encode()
        got = fast(body, 2, "http://e")
        assert got is None or same(got, body) is None
        assert (got is None) == (sep[1] == ": ")   # the entries' key is looked for as engines write it
    _set_lp(outs, None)
    for indent in (None, 1):
        assert fast(json.dumps(outs, indent=indent, separators=(", ", ":")).encode(), 2,
                                        "http://e") is None


_VALUES = [0, 1, 7, -1, 2**31 - 1, 2**31, 2**70, 2.5, -0.0, 0.0, -0.1, -3.25, 5e-7, 1e-5, 0.5, -1e308,
           float("nan"), float("inf"), True, None, "x", "]]", [], [-0.1], {}]


def _mutate(data: st.DataObject, out: dict) -> None:
    ids, entries = out["output_ids"], out["meta_info"]["output_token_logprobs"]
    value = st.sampled_from(_VALUES)
    kind = data.draw(st.sampled_from(["lp", "id", "entry_id", "entry", "third", "drop", "add", "finish"]))
    i = data.draw(st.integers(0, max(0, len(entries) - 1)))
    if kind == "finish":
        out["meta_info"]["finish_reason"] = data.draw(st.sampled_from(["stop", {"type": "abort"}, "x", None]))
    elif kind == "add":
        entries.append(data.draw(st.lists(value, max_size=4)))
    elif not entries:
        return
    elif kind in ("lp", "entry_id", "third"):
        j = ("lp", "entry_id", "third").index(kind)
        if isinstance(entries[i], list) and len(entries[i]) > j:
            entries[i][j] = data.draw(value)
    elif kind == "id":
        if i < len(ids):
            ids[i] = data.draw(value)
    elif kind == "entry":
        entries[i] = data.draw(st.lists(value, max_size=4) | value)
    else:
        entries.pop(i)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_whatever_the_answer_the_fast_path_reads_what_orjson_reads_or_steps_aside(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 6))
    ids = data.draw(st.lists(st.integers(0, 150_000), min_size=n, max_size=n))
    lps = data.draw(st.lists(st.floats(-50, -1e-9), min_size=n, max_size=n))
    out = {"text": data.draw(st.text(max_size=8)), "output_ids": ids, "meta_info": {
        "finish_reason": "length", "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}
    mutations = data.draw(st.integers(0, 2))
    for _ in range(mutations):
        _mutate(data, out)
    body = json.dumps([out]).encode()   # NaN as NaN and spaced; orjson (when it can: not 2**70) compact, NaN as null
    if data.draw(st.booleans()):
        try:
            body = orjson.dumps([out])
        except TypeError:
            pass
    got = fast(body, 1, "http://e")
    event("fast path" if got is not None else "orjson path")
    if mutations == 0 and body[:2] == b'[{' and b'": ' not in body:
        assert got is not None   # a plain answer as engines write it takes the fast path
    if got is None:
        return
    try:
        slow(body)
    except (Retryable, ValueError) as e:   # (orjson.JSONDecodeError is a ValueError)
        raise AssertionError(f"the fast path accepted what the orjson path refuses: {e}") from None
    same(got, body)


def test_the_transport_answers_long_batches_compact_and_the_rest_as_before() -> None:
    long_body = orjson.dumps([answer(i, 600) for i in range(4)])
    short_body = orjson.dumps([answer(i, 20) for i in range(4)])

    async def generate(request: web.Request) -> web.Response:
        req = await request.json()
        body = long_body if req["sampling_params"]["max_new_tokens"] == 600 else short_body
        if not isinstance(req["input_ids"][0], list):   # one sequence: its own answer, not a list
            body = orjson.dumps(orjson.loads(body)[0])
        return web.Response(body=body, content_type="application/json")

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        import httpx
        t = Transport(httpx.AsyncClient(), 30.0, window_s=0.05, max_batch=4)
        url = f"http://127.0.0.1:{port}"
        try:
            long = await asyncio.gather(*t.submit(url, [1, 2], {"max_new_tokens": 600}, 4, compact=True))
            same(long, long_body)
            assert t.compact_answers == 4
            plain = await asyncio.gather(*t.submit(url, [1, 2], {"max_new_tokens": 600}, 4))
            assert all(a.entries is a["meta_info"]["output_token_logprobs"] for a in plain)   # not asked: as before
            short = await asyncio.gather(*t.submit(url, [1, 2], {"max_new_tokens": 20}, 4, compact=True))
            assert all(a.entries is not None for a in short) and t.compact_answers == 4   # orjson is as fast there
            one = await t.post(url, [1, 2], {"max_new_tokens": 600})
            assert one.entries is not None and logprobs_of(one) == logprobs_of(long[0])
        finally:
            await t.close()
            await runner.cleanup()

    asyncio.run(run())


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx
    monkeypatch.setenv("HEADRACE_FAST_ANSWERS_MIN_BYTES", "0")
    assert Transport(httpx.AsyncClient(), 1.0).fast_min_bytes == 0
    monkeypatch.setenv("HEADRACE_FAST_ANSWERS_MIN_BYTES", "lots")
    with pytest.raises(ValueError, match="HEADRACE_FAST_ANSWERS_MIN_BYTES must be a whole number"):
        Transport(httpx.AsyncClient(), 1.0)
