"""``/generate`` over HTTP for one sequence, with coalescing into SGLang batch requests.

Short generations are dominated by the cost of an HTTP request on both ends, not by the model:
on the 2-core machine 256 eight-token sequences took ~2.8 s as 256 requests and ~0.26 s as 32
requests of 8 (same engine, same concurrency). So sequences headed for the same engine with the same
sampling params within ``window_s`` of each other travel as one batch request (``input_ids`` a list
of prompts, one ``sampling_params`` object: the form SGLang's ``/generate``, sglang-router and the
reference engine all accept; sglang-router 0.3.2 refuses a list of sampling params), at most
``max_batch`` per request.

Guarantees of ``Transport.post(url, input_ids, params)``, batched or not:
- the caller gets what a single-sequence ``/generate`` would give it: that sequence's answer, checked
  (``rollout.answers``: ``check_answer``, or ``check_short_batch`` for a batch of short answers
  at once, the same outcome), or the exception a single request would raise: ``httpx.TransportError`` /
  ``httpx.TimeoutException`` (connection or timeout; a batch shares its fate), ``Retryable`` (5xx,
  429 Too Many Requests: an engine's queue bound, unusable body) or ``EngineError`` (other 4xx);
- a batch answered 4xx is sent again one sequence per request, so one bad sequence (a token
  outside the vocabulary, say) fails only its own caller; when every sequence then succeeds alone,
  the server does not take batches and that URL gets one sequence per request from then on (logged
  once);
- ``n`` != 1 in the sampling params is an ``EngineError`` (one call, one sequence) and sends nothing;
  ``window_s <= 0`` turns coalescing off;
- a cancelled caller leaves the others' answers untouched;
- ``submit_group`` settles a group's copies as one future (their answers or errors in a list),
  without a future and a callback per sequence;
- ``lora`` (a LoRA adapter's name, ``trainer.lora_sync: adapter``) goes into the body as SGLang's
  ``lora_path``; only sequences for the same adapter share a batch;
- ``submit(..., compact=True)`` (the default generator's groups) may answer with compact
  ``Answer``s: a batch whose answers average ``HEADRACE_FAST_ANSWERS_MIN_BYTES`` (8192) bytes or
  more is read by ``rollout.fast_answers`` (simdjson, no Python object per token: at 2,048 tokens
  the rollout service's CPU per group fell from ~5.1 to ~3.0 ms in ``bench/fleet_sim.py``), the
  same values as the orjson path gives, or that path where the module is not sure.

The requests to a plain ``http://`` engine go out through ``shared.eager_http`` (kept-alive
connections, the request on the socket before the call returns; in ``bench/rollout_bench.py`` the
service's CPU per 32-group round fell from 12.4-13.4 ms with aiohttp to 11.2-12.0 ms); to any
other URL through ``shared.aio.AioHTTP`` (aiohttp). Either way the errors are the httpx exceptions
named above (connection refused: ``httpx.ConnectError``, no answer in ``timeout_s``:
``httpx.ReadTimeout``, connection lost: ``httpx.ReadError``); a request whose kept-alive
connection turns out closed before any byte of its answer is written once more on a new one (the
engine never saw it). The ``Authorization`` header of the ``http`` client given is sent with every
request; proxy variables of the environment are not used for engines.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable

import httpx
import orjson

from headrace.rollout import fast_answers
from headrace.rollout.answers import Answer, EngineError, Retryable, check_answer, check_short_batch, finish_reason
from headrace.shared.aio import AioHTTP, Reply
from headrace.shared.eager_http import EagerHTTP

log = logging.getLogger("headrace.rollout.transport")
_JSON = {"content-type": "application/json"}


def one_sequence(params: dict[str, Any]) -> None:
    """``EngineError`` unless the sampling params ask for one sequence per call (``n`` 1)."""
    if params.get("n", 1) != 1:
        raise EngineError(f"a /generate call here is for one sequence: sampling_params n must be 1, "
                          f"got {params.get('n')!r} (make one call per sample)")


class _Share:
    """Where one sequence of a ``submit_group`` call is settled: its place in the group's list,
    which resolves the group's one future once every place is filled. To the transport it is a
    future (``done``, ``cancelled``, ``exception``, ``set_result``, ``set_exception``, ``cancel``);
    a cancelled sequence (the batch's fate) leaves a ``CancelledError`` in its place, as
    ``asyncio.gather(..., return_exceptions=True)`` would; a cancelled group future leaves every
    place done, so its sequences are not sent."""

    __slots__ = ("group", "index", "error", "filled")

    def __init__(self, group: "_Group", index: int) -> None:
        self.group, self.index, self.error, self.filled = group, index, None, False

    def done(self) -> bool:
        return self.filled or self.group.future.done()

    def cancelled(self) -> bool:
        return not self.filled and self.group.future.cancelled()

    def exception(self) -> BaseException | None:
        return self.error

    def set_result(self, value: Any) -> None:
        self.group.fill(self, value)

    def set_exception(self, error: BaseException) -> None:
        if not self.filled:
            self.error = error
            self.group.fill(self, error)

    def cancel(self) -> None:
        self.set_exception(asyncio.CancelledError())


class _Group:
    __slots__ = ("future", "results", "left")

    def __init__(self, future: asyncio.Future, n: int) -> None:
        self.future, self.results, self.left = future, [None] * n, n

    def fill(self, share: _Share, value: Any) -> None:
        if share.filled:
            return
        share.filled = True
        self.results[share.index] = value
        self.left -= 1
        if not self.left and not self.future.done():
            self.future.set_result(self.results)


@dataclass
class _Waiting:
    input_ids: list[int]
    params: dict[str, Any]
    future: Any   # an asyncio.Future, or a ``_Share`` of a group's
    lora: str | None = None
    compact: bool = False


@dataclass
class _Queue:
    items: list[_Waiting] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


def _params_key(params: dict[str, Any]) -> bytes | str:
    """A canonical text of sampling params (keys sorted): equal params, equal key, in this process."""
    try:
        return orjson.dumps(params, option=orjson.OPT_SORT_KEYS, default=str)   # ~10x the stdlib's speed
    except TypeError:   # e.g. non-string keys, which orjson refuses
        return json.dumps(params, sort_keys=True, default=str)


class Transport:
    """Posts /generate for one sequence at a time, coalescing concurrent ones per engine URL."""

    def __init__(self, http: httpx.AsyncClient, timeout_s: float, window_s: float = 0.002,
                 max_batch: int = 32) -> None:
        self.timeout_s = timeout_s
        auth = http.headers.get("authorization")   # only its token is used (see the module docstring)
        self.wire = AioHTTP({"authorization": auth} if auth else {})   # https engines (eager_http: plain http)
        self._eager: dict[str, EagerHTTP] = {}   # engine URL -> its connections
        self.window_s = window_s
        self.max_batch = max(1, max_batch)
        self.fast_min_bytes = fast_min_bytes()
        self._queues: dict[tuple[str, str, str | None, bool], _Queue] = {}   # by (URL, params, adapter, compact)
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0   # HTTP /generate requests sent
        self.sequences = 0  # sequences they carried
        self.refused_batches = 0  # batches answered 4xx and resent one sequence per request
        self.compact_answers = 0  # answers read by rollout.fast_answers
        self.no_batch: set[str] = set()  # URLs that refused a batch whose sequences were all fine alone

    async def post(self, url: str, input_ids: list[int], params: dict[str, Any],
                   lora: str | None = None) -> dict[str, Any]:
        """The checked answer for one sequence (see the module docstring for the errors)."""
        one_sequence(params)
        if not self.coalesces(url):
            return await self._single(url, input_ids, params, lora)
        return await self.submit(url, input_ids, params, 1, lora)[0]

    def coalesces(self, url: str) -> bool:
        """Whether sequences for ``url`` are coalesced into batch requests (``submit`` needs it)."""
        return self.window_s > 0 and self.max_batch > 1 and url not in self.no_batch

    def submit(self, url: str, input_ids: list[int], params: dict[str, Any], copies: int,
               lora: str | None = None, compact: bool = False) -> list[asyncio.Future]:
        """Queue ``copies`` sequences of ``input_ids`` (a group's samples) for ``url`` at once; one
        future each, settled as ``post`` would answer that sequence. Only where ``coalesces(url)``,
        with ``n`` 1 in ``params`` (the caller checks both). ``compact``: long answers may come as
        compact ``Answer``s (no SGLang entries: see ``Answer``), for a caller that reads them only
        through ``logprobs_of`` / ``entries_of``."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future] = [loop.create_future() for _ in range(copies)]
        self._queue(url, input_ids, params, futs, lora, compact)
        return futs

    def submit_group(self, url: str, input_ids: list[int], params: dict[str, Any], copies: int,
                     lora: str | None = None, compact: bool = False) -> asyncio.Future:
        """``submit`` with one future for the ``copies`` sequences: their answers in a list, each
        the answer or the exception its own future would hold (a cancellation as a
        ``CancelledError``), as ``asyncio.gather(*submit(...), return_exceptions=True)`` gives
        them, without a future and a callback per sequence. Cancelling it withdraws the sequences
        not yet sent."""
        fut = asyncio.get_running_loop().create_future()
        group = _Group(fut, copies)
        self._queue(url, input_ids, params, [_Share(group, i) for i in range(copies)], lora, compact)
        return fut

    def _queue(self, url: str, input_ids: list[int], params: dict[str, Any], futs: list[Any],
               lora: str | None, compact: bool) -> None:
        key = (url, _params_key(params), lora, compact)   # one batch, one sampling_params
        q = None
        for fut in futs:
            if q is None:
                q = self._queues.get(key)
                if q is None:
                    q = self._queues[key] = _Queue()
                    q.timer = asyncio.get_running_loop().call_later(self.window_s, self._flush, key)
            q.items.append(_Waiting(input_ids, params, fut, lora, compact))
            if len(q.items) >= self.max_batch:
                self._flush(key)
                q = None

    async def _single(self, url: str, input_ids: list[int], params: dict[str, Any],
                      lora: str | None = None) -> dict[str, Any]:
        self.requests += 1
        self.sequences += 1
        r = await self._generate(url, {"input_ids": input_ids, "sampling_params": params, "return_logprob": True,
                                       **({"lora_path": lora} if lora else {})})
        _raise_for_status(r, url)
        out = _json(r, url)
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        return check_answer(out, url)

    def _flush(self, key: tuple[str, str, str | None, bool]) -> None:
        q = self._queues.pop(key, None)
        if q is None:
            return
        url = key[0]
        if q.timer is not None:
            q.timer.cancel()
        items = [w for w in q.items if not w.future.done()]  # callers cancelled while waiting
        if not items:
            return
        task = asyncio.get_running_loop().create_task(self._send(url, items))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, url: str, items: list[_Waiting]) -> None:
        if len(items) == 1:
            await self._deliver_single(url, items[0])
            return
        try:
            self.requests += 1
            self.sequences += len(items)
            r = await self._generate(url, {
                "input_ids": [w.input_ids for w in items], "sampling_params": items[0].params,
                "return_logprob": True, **({"lora_path": items[0].lora} if items[0].lora else {})})
            if 400 <= r.status_code < 500 and r.status_code != 429:
                # which sequence is bad is not known: ask one by one, so only that caller fails
                self.refused_batches += 1
                await asyncio.gather(*(self._deliver_single(url, w) for w in items))
                if not any(isinstance(w.future.exception(), EngineError) for w in items
                           if w.future.done() and not w.future.cancelled()):
                    # every sequence was fine alone: this server does not take batch requests
                    if url not in self.no_batch:
                        log.warning("%s refused a batch /generate (%d: %s); sending one sequence per request "
                                "there from now on", url, r.status_code, r.text[:300])
                    self.no_batch.add(url)
                return
            _raise_for_status(r, url)
            fast = _fast_batch(r.content, len(items), self.fast_min_bytes) if items[0].compact else None
            if fast is not None:
                self.compact_answers += len(fast)
                for w, a in zip(items, fast):
                    _settle(w.future, result=a)
                return
            outs = _json(r, url)
            if not isinstance(outs, list) or len(outs) != len(items):
                got = f"{len(outs)} results" if isinstance(outs, list) else f"a {type(outs).__name__}"
                raise Retryable(f"{url}/generate answered an unusable body for a batch of {len(items)} "
                                f"sequences ({got}, not a list of {len(items)})")
        except BaseException as e:  # noqa: BLE001 - every caller gets the batch's fate
            for w in items:
                _settle(w.future, error=e)
            if not isinstance(e, Exception):
                raise
            return
        checked = check_short_batch(outs)
        if checked is not None:
            for w, a in zip(items, checked):
                _settle(w.future, result=a)
            return
        for w, out in zip(items, outs):
            try:
                _settle(w.future, result=check_answer(out, url))
            except Retryable as e:
                _settle(w.future, error=e)

    def _generate(self, url: str, body: dict[str, Any]) -> Awaitable[Reply]:
        """POST ``body`` to ``url``/generate: through ``shared.eager_http`` (the request on the socket
        before this returns) for a plain ``http://`` engine, through aiohttp otherwise."""
        if not url.startswith("http://"):
            return self.wire.post_json(f"{url}/generate", body, self.timeout_s)
        eager = self._eager.get(url)
        if eager is None:
            eager = self._eager[url] = EagerHTTP(url, self.wire.headers)
        try:
            data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError:
            data = json.dumps(body).encode()
        return eager.post("/generate", data, _JSON, self.timeout_s)

    async def _deliver_single(self, url: str, w: _Waiting) -> None:
        try:
            _settle(w.future, result=await self._single(url, w.input_ids, w.params, w.lora))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            _settle(w.future, error=e)
            if not isinstance(e, Exception):
                raise

    async def close(self) -> None:
        for key in list(self._queues):
            q = self._queues.pop(key)
            if q.timer is not None:
                q.timer.cancel()
            for w in q.items:
                w.future.cancel()
        for t in list(self._tasks):
            t.cancel()
        for eager in self._eager.values():
            await eager.close()
        await self.wire.close()


FAST_MIN_BYTES_ENV = "HEADRACE_FAST_ANSWERS_MIN_BYTES"
FAST_MIN_BYTES = 8192   # answers of this many bytes on average (~200 tokens) or more try ``rollout.fast_answers``


def fast_min_bytes() -> int:
    """``FAST_MIN_BYTES``, or the environment's ``HEADRACE_FAST_ANSWERS_MIN_BYTES`` (0: every
    compact batch tries the fast path; a huge number: none does)."""
    raw = os.environ.get(FAST_MIN_BYTES_ENV, str(FAST_MIN_BYTES))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{FAST_MIN_BYTES_ENV} must be a whole number of bytes per answer, got {raw!r}")
    return value


def _fast_batch(body: bytes, n: int, min_bytes: int) -> list[Answer] | None:
    """A batch body's compact answers (``rollout.fast_answers``), or None: short answers (orjson is
    as fast below ~128 tokens), or anything that module or ``check_answer``'s finish_reason rule
    is not sure of."""
    if len(body) < min_bytes * n:
        return None
    parsed = fast_answers.parse_batch(body, n)
    if parsed is None:
        return None
    answers = []
    for out, logprobs, arrays in parsed:
        meta = out["meta_info"]
        try:
            meta["finish_reason"] = finish_reason(meta["finish_reason"])
        except (KeyError, ValueError):
            return None
        answers.append(Answer.of(out, None, logprobs, arrays))
    return answers


def _settle(fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if isinstance(error, asyncio.CancelledError):
        fut.cancel()
    elif error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _raise_for_status(r: Reply, url: str) -> None:
    if r.status_code >= 500 or r.status_code == 429:   # 429: the engine's queue is full; come back later
        raise Retryable(f"{url}/generate answered {r.status_code}: {r.text[:300]}")
    if r.status_code >= 400:
        raise EngineError(f"{url}/generate answered {r.status_code}: {r.text[:500]}")


def _json(r: Reply, url: str) -> Any:
    """The parsed body. The cyclic GC is paused meanwhile: an answer of 32 x 2,048 tokens is ~200k
    new objects, and the collections their allocation triggers (walking every live object of the
    service) made parsing ~5x slower; the tree has no cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(r.content)   # several times faster than the stdlib on logprob lists
    except ValueError:
        raise Retryable(f"{url}/generate answered non-JSON: {r.text[:200]!r}") from None
    finally:
        if was:
            gc.enable()
