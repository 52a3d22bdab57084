"""rollout.transport: concurrent sequences coalesced into batch /generate requests, on loopback.

Against a real reference engine (``headrace engine serve``): answers go back to the right caller,
batches form, a sequence the engine refuses (a token outside the vocabulary) fails only its own
caller, and ``n`` != 1 is refused before anything is sent. Against small stand-in servers (real
uvicorn processes): a 5xx, a batch answer of the wrong length and a dead port reach every caller of
the batch as the error a single request would have given; a server that refuses batches is sent
one sequence per request from then on.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from headrace.rollout.transport import EngineError, Retryable, Transport
from tests.procs import Proc, child_env, free_port, reference_engine


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from headrace.shared.modelzoo import init_model

    model = init_model("tiny-qwen2", tmp_path_factory.mktemp("models") / "tiny-qwen2")
    with reference_engine(model, tmp_path_factory.mktemp("logs") / "engine.log") as (url, _):
        yield url


def _run(coro_fn: Any, *args: Any) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(timeout=60) as http:
            return await coro_fn(http, *args)
    return asyncio.run(main())


def _params(k: int) -> dict[str, Any]:
    return {"max_new_tokens": 1 + k % 5, "temperature": 1.0, "ignore_eos": True}


def test_concurrent_sequences_travel_as_batches_and_each_caller_gets_its_own_answer(engine_url: str) -> None:
    async def go(http: httpx.AsyncClient) -> tuple[list[Any], Transport]:
        t = Transport(http, timeout_s=60, window_s=0.05, max_batch=16)
        prompts = [[3 + (i * 7 + j) % 150 for j in range(2 + i % 9)] for i in range(40)]
        outs = await asyncio.gather(*(t.post(engine_url, p, _params(i)) for i, p in enumerate(prompts)))
        await t.close()
        return [(p, o) for p, o in zip(prompts, outs)], t

    pairs, t = _run(go)
    for i, (p, out) in enumerate(pairs):   # distinct prompt lengths and budgets: a mix-up would show
        assert out["meta_info"]["prompt_tokens"] == len(p)
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == _params(i)["max_new_tokens"]
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    # one batch per sampling params (5 kinds, 8 sequences each), a few more if the window split one
    assert t.sequences == 40 and t.requests <= 8 and t.refused_batches == 0


def test_a_groups_copies_submitted_at_once_travel_in_one_batch_each_with_its_own_answer(engine_url: str) -> None:
    """``submit`` (the default generator's group path): k copies of one prompt, one future each;
    more copies than a batch holds start a second batch."""
    async def go(http: httpx.AsyncClient) -> tuple[list[Any], list[Any], Transport]:
        t = Transport(http, timeout_s=60, window_s=0.05, max_batch=8)
        assert t.coalesces(engine_url)
        params = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
        five = await asyncio.gather(*t.submit(engine_url, [5, 6, 7], params, 5))
        sent = t.requests
        eleven = await asyncio.gather(*t.submit(engine_url, [5, 6, 7, 8], params, 11))
        await t.close()
        return five + eleven, [sent, t.requests], t

    outs, sent, t = _run(go)
    assert len(outs) == 16 and all(len(o["output_ids"]) == 4 == len(o["meta_info"]["output_token_logprobs"]) for o in outs)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3] * 5 + [4] * 11
    assert len({id(o) for o in outs}) == 16                # each copy its own answer object
    assert sent == [1, 3] and t.sequences == 16            # 5 in one batch; 11 = a full batch of 8, then 3


def test_a_group_as_one_future_gets_what_gathering_its_copies_gives(engine_url: str) -> None:
    """``submit_group``: one future for k copies, settled with the list ``asyncio.gather(*submit(...),
    return_exceptions=True)`` gives: answers in order, each its own object; a copy the engine refuses
    holds its error in its place; a cancelled group is withdrawn before it is sent."""
    async def go(http: httpx.AsyncClient) -> tuple[list[Any], list[Any], list[Any], list[int], Transport]:
        t = Transport(http, timeout_s=60, window_s=0.05, max_batch=8)
        params = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
        eleven = await t.submit_group(engine_url, [5, 6, 7, 8], params, 11)     # a full batch of 8, then 3
        sent = [t.requests]
        # a group and a sequence outside the vocabulary share a batch: refused (400), resent one by one
        good = t.submit_group(engine_url, [5, 6], params, 3)
        bad_group = t.submit_group(engine_url, [5, 10**7], params, 2)
        mixed = await asyncio.gather(good, bad_group)
        sent.append(t.requests)
        t.window_s = 30.0   # queued, not yet sent: a cancelled group is withdrawn, the others go on
        withdrawn = t.submit_group(engine_url, [9, 9], params, 4)
        withdrawn.cancel()
        got = await asyncio.gather(*(t.post(engine_url, [9, 9], params) for _ in range(4)))   # fills the batch
        sent.append(t.sequences)
        await t.close()
        return eleven, mixed, got, sent, t

    eleven, (good, bad), alone, sent, t = _run(go)
    assert len(eleven) == 11 and len({id(o) for o in eleven}) == 11
    assert all(o["meta_info"]["prompt_tokens"] == 4 and len(o["output_ids"]) == 3 for o in eleven)
    assert sent[0] == 2                                    # 11 copies: two batches
    assert [o["meta_info"]["prompt_tokens"] for o in good] == [2, 2, 2]
    assert len(bad) == 2 and all(isinstance(e, EngineError) and "400" in str(e) for e in bad)
    assert sent[1] == 2 + 1 + 5 and t.refused_batches == 1   # the batch of 5, then each alone
    assert [o["meta_info"]["prompt_tokens"] for o in alone] == [2] * 4
    assert sent[2] == 11 + 5 + 5 + 4                       # the withdrawn group's 4 never went


def test_a_refused_sequence_fails_alone_and_n_above_1_is_refused(engine_url: str) -> None:
    async def go(http: httpx.AsyncClient) -> tuple[list[Any], Transport]:
        t = Transport(http, timeout_s=60, window_s=0.05, max_batch=16)
        calls = [t.post(engine_url, [5, 6, 7], _params(0)) for _ in range(5)]
        calls.insert(2, t.post(engine_url, [5, 10**7], _params(0)))           # outside the vocabulary
        calls.append(t.post(engine_url, [8, 9], {"max_new_tokens": 2, "n": 2, "ignore_eos": True}))
        outs = await asyncio.gather(*calls, return_exceptions=True)
        await t.close()
        return outs, t

    outs, t = _run(go)
    assert isinstance(outs[2], EngineError) and "400" in str(outs[2])
    good = outs[:2] + outs[3:6]
    assert all(isinstance(o, dict) and o["meta_info"]["prompt_tokens"] == 3 for o in good)
    assert isinstance(outs[6], EngineError) and "n must be 1" in str(outs[6])   # nothing sent
    # the batch of 6 was refused (400), then resent one by one; the engine still takes batches
    assert t.requests == 1 + 6 and t.refused_batches == 1 and not t.no_batch


FAKE = """
import sys, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
app = FastAPI()
mode = sys.argv[2]
@app.get("/health")
async def health():
    return {}
@app.post("/generate")
async def generate(request: Request):
    body = await request.json()
    if mode in ("500", "429"):      # 429: an engine whose queue is full (--max-queued)
        return JSONResponse({"error": "boom"}, status_code=int(mode), headers={"Retry-After": "1"})
    batch = isinstance(body["input_ids"][0], list)
    one = {"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "length"},
           "output_token_logprobs": [[-0.5, 1, None]]}}
    if mode == "auth":              # an engine behind the run token: answers only the bearer
        if request.headers.get("authorization") != "Bearer s3cret":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return [one] * len(body["input_ids"]) if batch else one
    if mode == "slow":              # never answers in time
        import asyncio
        await asyncio.sleep(30)
    if mode == "nobatch":           # takes one sequence per request only
        return JSONResponse({"error": "input_ids: expected a list of ints"}, status_code=422) if batch else one
    return [one] * (len(body["input_ids"]) - 1 if batch else 0)          # one answer short
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _fake(tmp_path: Path, mode: str) -> tuple[str, Proc | None]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if mode == "dead":
        return url, None
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    proc = Proc([sys.executable, str(script), str(port), mode], tmp_path / "fake.log", env=child_env())
    proc.wait_http(f"{url}/health", timeout=60)
    return url, proc


def test_a_server_that_refuses_batches_gets_one_sequence_per_request(tmp_path: Path) -> None:
    url, proc = _fake(tmp_path, "nobatch")
    try:
        async def go(http: httpx.AsyncClient) -> tuple[list[Any], list[Any], Transport]:
            t = Transport(http, timeout_s=30, window_s=0.05, max_batch=16)
            first = await asyncio.gather(*(t.post(url, [1, 2], _params(0)) for _ in range(4)))
            sent = t.requests
            second = await asyncio.gather(*(t.post(url, [1, 2], _params(0)) for _ in range(4)))
            await t.close()
            return first + second, [sent, t.requests], t

        outs, sent, t = _run(go)
        assert all(o["output_ids"] == [1] for o in outs)
        assert sent == [1 + 4, 1 + 4 + 4] and t.refused_batches == 1 and t.no_batch == {url}
    finally:
        proc.stop()


@pytest.mark.parametrize("mode,error", [("500", Retryable), ("429", Retryable), ("short", Retryable),
                                        ("dead", httpx.ConnectError)])
def test_a_failed_batch_reaches_every_caller_as_the_single_request_error(tmp_path: Path, mode: str, error: type) -> None:
    url, proc = _fake(tmp_path, mode)
    try:
        async def go(http: httpx.AsyncClient) -> list[Any]:
            t = Transport(http, timeout_s=30, window_s=0.05, max_batch=16)
            outs = await asyncio.gather(*(t.post(url, [1, 2], _params(i)) for i in range(4)), return_exceptions=True)
            await t.close()
            return outs

        outs = _run(go)
        assert len(outs) == 4 and all(isinstance(o, error) for o in outs), outs
    finally:
        if proc is not None:
            proc.stop()


def test_a_failed_batch_fills_every_place_of_a_group_with_the_error(tmp_path: Path) -> None:
    async def go(http: httpx.AsyncClient, url: str) -> list[Any]:
        t = Transport(http, timeout_s=30, window_s=0.01, max_batch=8)
        outs = await t.submit_group(url, [1, 2], {"max_new_tokens": 1}, 3)
        await t.close()
        return outs

    url, proc = _fake(tmp_path, "500")
    try:
        outs = _run(go, url)
    finally:
        proc.stop()
    assert len(outs) == 3 and all(isinstance(o, Retryable) and "500" in str(o) for o in outs)


def test_coalescing_off_sends_one_request_per_sequence(engine_url: str) -> None:
    async def go(http: httpx.AsyncClient) -> Transport:
        t = Transport(http, timeout_s=60, window_s=0.0)
        await asyncio.gather(*(t.post(engine_url, [4, 5, 6], _params(i)) for i in range(5)))
        await t.close()
        return t

    t = _run(go)
    assert t.requests == t.sequences == 5


def test_the_clients_bearer_token_goes_with_every_request_and_a_slow_engine_times_out(tmp_path: Path) -> None:
    url, proc = _fake(tmp_path, "auth")
    (tmp_path / "slow").mkdir()
    slow_url, slow = _fake(tmp_path / "slow", "slow")
    try:
        async def go(http: httpx.AsyncClient) -> tuple[list[Any], list[Any], list[Any]]:
            t = Transport(http, timeout_s=1.5, window_s=0.05, max_batch=16)
            ok = await asyncio.gather(*(t.post(url, [1, 2], _params(0)) for _ in range(3)), return_exceptions=True)
            late = await asyncio.gather(*(t.post(slow_url, [1, 2], _params(0)) for _ in range(3)),
                                        return_exceptions=True)
            await t.close()
            async with httpx.AsyncClient() as bare:   # no token
                t2 = Transport(bare, timeout_s=30, window_s=0.05, max_batch=16)
                refused = await asyncio.gather(*(t2.post(url, [1, 2], _params(0)) for _ in range(2)),
                                               return_exceptions=True)
                await t2.close()
            return ok, late, refused

        async def main() -> Any:
            async with httpx.AsyncClient(headers={"Authorization": "Bearer s3cret"}) as http:
                return await go(http)

        ok, late, refused = asyncio.run(main())
        assert all(isinstance(o, dict) and o["output_ids"] == [1] for o in ok), ok
        assert all(isinstance(o, httpx.ReadTimeout) for o in late), late      # a TransportError: rerouted
        assert all(isinstance(o, EngineError) and "401" in str(o) for o in refused), refused
    finally:
        for p in (proc, slow):
            if p is not None:
                p.stop()
