"""Pushes finished groups to the buffer: batched, retried until the buffer answers, idempotent.

Guarantees:
- A group handed to ``push`` is resolved only when the buffer answered 200 for it (accepted or
  duplicate), or 422/413 for that group alone (rejected: it can never be stored; logged).
- While the buffer is down or full (connection errors, 5xx, 429) the pusher waits with capped
  backoff and retries for ever; nothing is dropped. Because group ids and uids are deterministic,
  a retry of a POST whose answer was lost is counted as a duplicate by the buffer, never stored twice.
- Groups travel as one columnar body per batch (``columns_push.encode_groups``), as rows when
  columns cannot carry a value exactly. Groups are sent in batches of up to ``push_batch``; a
  batch refused as invalid or too large is split so that only the offending group is rejected.
- A columnar body's first attempt goes through ``AsyncBufferClient.post_columns_now``
  (``shared.eager_http``: a fraction of aiohttp's CPU per request) where the buffer URL is plain
  ``http://``; when it fails short of a final answer (429, 5xx, a lost connection) the retrying
  ``post_columns`` takes over. A final answer (422, 413, 401, ...) is handled as above.
- At most ``MAX_IN_FLIGHT`` batches are posted at once; what is queued meanwhile goes as the next
  batch.
- The loop's groups (``enqueue``) wait for company: a batch goes when ``push_batch`` groups are
  queued, when the producer says nothing more is coming soon (``flush``: the loop calls it when no
  group is left in production, e.g. at the end of a ``generate_batch`` round), or ``linger_s``
  after the first of them was queued (``LINGER_S``: 50 ms on_demand, 5 ms continuous), whichever
  comes first; ``push`` (the agent gateway's) posts on the pusher's next turn, with whatever is
  queued then. A batch that goes because it is full or flushed is written before the call returns
  (``AsyncBufferClient.post_columns_now``) when a post may start, else by the pusher's task as
  soon as one may.

On the 2-core machine (``bench/rollout_bench.py``, 2 engines, 32 groups a round) a round's groups
now go as one POST once the last is built, where they went as 5-6 POSTs of ~8 groups while the
engines were still rendering their answers: the buffer's CPU per POST (~0.6 ms fixed) no longer
competes with the engines and the service for the 2 cores in that phase. Same-run A/B of
alternate rounds (traced): the service's round 0.7 and 2.2 ms shorter (101.5 / 102.2 and 105.8 /
108.1 ms), from the engines' first finished sequence to the answer ~1.9 ms shorter, though the
one POST at the end adds ~1.9 ms after the last answer. Until 6 Dec (eighteenth session) ``push``
posted at once at 8 queued groups (``EAGER_GROUPS``) and the task whatever was queued at its next
turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from headrace.rollout.columns_push import Packed, encode_groups
from headrace.shared import columns as cols
from headrace.shared.aio import Reply
from headrace.shared.client import RETRY_STATUS, AsyncBufferClient, BufferError
from headrace.shared.schemas import Group

log = logging.getLogger("headrace.rollout.push")

Outcome = Literal["accepted", "duplicate", "rejected"]
MAX_IN_FLIGHT = 4
# how long the loop's first queued group may wait for company (``enqueue``): on_demand, nobody reads
# a round's groups before the round ends (which flushes); continuous, the trainer may be waiting
LINGER_S = {"on_demand": 0.05, "continuous": 0.005}
_Started = tuple[bytes, "asyncio.Future[Reply]"]   # a columnar body and its first attempt, already written
_Item = tuple[Group, "asyncio.Future[Outcome]", Packed | None]


@dataclass
class PushStats:
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    retries: int = 0
    from_arrays: int = 0   # samples pushed from the arrays the transport checked (``columns_push.Packed``)
    eager_posts: int = 0   # batches whose POST was written by ``enqueue`` / ``flush`` itself
    posts: int = 0         # batches posted (first attempts)
    buffer_up: bool = True


class Pusher:
    """One background task draining a queue of groups into the buffer."""

    def __init__(self, client: AsyncBufferClient, batch: int, retry_max_s: float,
                 linger_s: float = LINGER_S["continuous"]) -> None:
        self.client = client
        self.batch = batch
        self.retry_max_s = retry_max_s
        self.linger_s = linger_s
        self.stats = PushStats()
        self._items: deque[_Item] = deque()
        self._queued = asyncio.Event()   # set while ``_items`` holds something
        self._kick = asyncio.Event()     # a full batch, a flush or ``push``: the task stops lingering
        self._task: asyncio.Task[None] | None = None
        self._posting: dict[asyncio.Task[None], int] = {}   # batches being posted -> their group count
        self._slot_free = asyncio.Event()
        self._since = 0.0   # when the oldest queued group was queued (loop time)

    @property
    def pending(self) -> int:
        """Groups not yet answered by the buffer (queued or being posted)."""
        return len(self._items) + sum(self._posting.values())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, flush_s: float = 5.0) -> None:
        """Give queued groups ``flush_s`` to reach the buffer, then stop (unpushed groups are
        regenerated after a restart: their data slots were not marked done)."""
        self._kick.set()
        deadline = asyncio.get_running_loop().time() + flush_s
        while self.pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self._task:
            self._task.cancel()
        for t in list(self._posting):
            t.cancel()

    def enqueue(self, group: Group, packed: Packed | None = None) -> "asyncio.Future[Outcome]":
        """Queue ``group`` (``packed``: its arrays, where the loop made them); the future holds the
        buffer's answer for it. It goes with a full batch, a ``flush`` or after ``linger_s``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] = loop.create_future()
        if not self._items:
            self._since = loop.time()   # the linger counts from the first group of a batch
        self._items.append((group, fut, packed))
        self._queued.set()
        if len(self._items) >= self.batch:
            self._post_soon()
        return fut

    def flush(self) -> None:
        """Nothing more is coming soon: post what is queued now, not after the linger."""
        if self._items:
            self._post_soon()

    async def push(self, group: Group, packed: Packed | None = None) -> Outcome:
        """The buffer's answer for ``group``, posted on the pusher's next turn (no lingering)."""
        fut = self.enqueue(group, packed)
        self._kick.set()
        return await fut

    def _post_soon(self) -> None:
        """Post a batch of what is queued without lingering: written now when a post may start
        (plain http, a free slot, the buffer answering), else by the task as soon as one may."""
        if not (self.client.posts_now and self._task is not None and self.stats.buffer_up
                and len(self._posting) < MAX_IN_FLIGHT):
            self._kick.set()
            return
        items = self._take()
        try:
            body = encode_groups([g for g, _, _ in items], [p for _, _, p in items])
        except cols.NotColumnar:   # rows: the task posts them (the buffer's row schema words what is wrong)
            self._start(items)
            return
        self.stats.eager_posts += 1
        self._start(items, (body, self.client.post_columns_now(body)))
        if self._items:   # more than a batch was queued: the rest as soon as a post may start
            self._kick.set()

    def _take(self) -> list[_Item]:
        items = [self._items.popleft() for _ in range(min(self.batch, len(self._items)))]
        if not self._items:
            self._queued.clear()
        else:
            self._since = asyncio.get_running_loop().time()
        return items

    async def _run(self) -> None:
        while True:
            await self._queued.wait()
            while self._items and not self._kick.is_set():   # wait for company (see the module docstring)
                left = self._since + self.linger_s - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._kick.wait(), left)
                except asyncio.TimeoutError:
                    pass
            self._kick.clear()
            while len(self._posting) >= MAX_IN_FLIGHT:
                self._slot_free.clear()
                await self._slot_free.wait()
            if self._items:   # (a flush may have posted them meanwhile)
                self._start(self._take())
                if self._items:
                    self._kick.set()

    def _start(self, items: list[_Item], started: _Started | None = None) -> None:
        self.stats.posts += 1
        t = asyncio.create_task(self._send(items, started))
        self._posting[t] = len(items)
        t.add_done_callback(self._posted)

    def _posted(self, t: asyncio.Task[None]) -> None:
        self._posting.pop(t, None)
        self._slot_free.set()

    async def _send(self, items: list[_Item], started: _Started | None = None) -> None:
        """Post ``items`` until the buffer answers for each (``started``: the first attempt)."""
        delay = 0.1
        while True:
            try:
                attempt, started = started, None
                r = await self._post([g for g, _, _ in items], [p for _, _, p in items], attempt)
            except BufferError as e:
                if e.status in (413, 422):
                    if len(items) > 1:
                        half = len(items) // 2
                        await self._send(items[:half])
                        await self._send(items[half:])
                        return
                    g, fut, _ = items[0]
                    log.error("buffer refused group %s (%d): %s", g.group_id, e.status, e.message)
                    self.stats.rejected += 1
                    _resolve(fut, "rejected")
                    return
                if e.status in (401, 403, 404):
                    log.error("buffer answered %d (%s); check buffer.url / auth.token; retrying", e.status, e.message)
                self.stats.retries += 1
                if self.stats.buffer_up:
                    log.warning("buffer unavailable (%s); holding %d groups and retrying", e, len(items))
                self.stats.buffer_up = False
                await asyncio.sleep(delay)
                delay = min(self.retry_max_s, delay * 2)
                continue
            except Exception as e:  # noqa: BLE001 - any transport oddity: retry, never drop
                self.stats.retries += 1
                self.stats.buffer_up = False
                log.warning("push failed (%s: %s); retrying", type(e).__name__, e)
                await asyncio.sleep(delay)
                delay = min(self.retry_max_s, delay * 2)
                continue
            if not self.stats.buffer_up:
                log.info("buffer reachable again")
            self.stats.buffer_up = True
            # The answer counts duplicates but does not name them; per-group outcomes are only
            # distinguishable when the whole batch was one or the other.
            self.stats.accepted += r.accepted
            self.stats.duplicates += r.duplicates
            self.stats.from_arrays += sum(len(p.used) for _, _, p in items if p is not None)
            each: Outcome = "duplicate" if r.accepted == 0 else "accepted"
            for _, fut, _ in items:
                _resolve(fut, each)
            return


    async def _post(self, groups: list[Group], packed: list[Packed | None], started: _Started | None = None) -> Any:
        if started is not None:
            body, attempt = started
        else:
            try:
                body = encode_groups(groups, packed)   # columns, converted in C (rollout/columns_push.py)
            except cols.NotColumnar:
                return await self.client.post_groups(groups)   # rows: the buffer's row schema names the problem
            attempt = self.client.post_columns_now(body) if self.client.posts_now else None
        if attempt is not None:
            try:   # one attempt through shared.eager_http: a fraction of aiohttp's CPU per request
                return self.client.posted(await attempt)
            except BufferError as e:
                if e.status not in RETRY_STATUS:
                    raise   # a final answer (422, 413, 401, ...), as post_columns raises it
            except httpx.HTTPError:
                pass
            # 429, 5xx or a failed connection: the retrying client (backoff, Retry-After) goes on
        return await self.client.post_columns(body)


def _resolve(fut: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not fut.done():
        fut.set_result(outcome)
