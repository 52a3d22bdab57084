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
  batch. (With one post at a time, the first group of a step went alone and the rest of the step,
  finished a moment later, waited for that round trip: ~70 ms from the engines' last answer to
  the end of a 32-group ``generate_batch`` on the 2-core machine.)
- Once ``eager_groups`` groups are queued and a post may start, ``push`` itself posts them (up to
  ``push_batch``), the request written before it returns, instead of leaving them to the pusher's
  task, which runs only after everything else queued for this turn of the event loop. An engine's
  batch answer finishes 16 groups or more in one turn: the buffer now stores the first of them
  while the service builds the rest, and the last POST of a ``generate_batch`` carries a part of
  them, not all. Only while the buffer answers and ``post_columns_now`` is offered.

On the 2-core machine (``bench/rollout_bench.py``, 2 engines, alternating runs; medians): the
first attempt through ``eager_http`` 0.887-0.898 against 0.874-0.879 with aiohttp; ``push``
posting at 8 queued groups 0.888 against 0.882 (5 pairs each). Both together with
``engines.coalesce_max`` 128: 0.89 against 0.879 (6 pairs, 4 of them better).
"""

from __future__ import annotations

import asyncio
import logging
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
EAGER_GROUPS = 8   # queued groups that ``push`` posts at once (0: never)
_Started = tuple[bytes, "asyncio.Future[Reply]"]   # a columnar body and its first attempt, already written
_Item = tuple[Group, "asyncio.Future[Outcome]", Packed | None]


@dataclass
class PushStats:
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    retries: int = 0
    from_arrays: int = 0   # samples pushed from the arrays the transport checked (``columns_push.Packed``)
    eager_posts: int = 0   # batches whose POST ``push`` wrote at once (``eager_groups``)
    buffer_up: bool = True


class Pusher:
    """One background task draining a queue of groups into the buffer."""

    def __init__(self, client: AsyncBufferClient, batch: int, retry_max_s: float,
                 eager_groups: int = EAGER_GROUPS) -> None:
        self.client = client
        self.batch = batch
        self.retry_max_s = retry_max_s
        self.eager_groups = eager_groups if client.posts_now else 0
        self.stats = PushStats()
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._posting: dict[asyncio.Task[None], int] = {}   # batches being posted -> their group count
        self._slot_free = asyncio.Event()
        self._waiting = 0   # groups taken from the queue, waiting for a post to return

    @property
    def pending(self) -> int:
        """Groups not yet answered by the buffer (queued or being posted)."""
        return self._queue.qsize() + self._waiting + sum(self._posting.values())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, flush_s: float = 5.0) -> None:
        """Give queued groups ``flush_s`` to reach the buffer, then stop (unpushed groups are
        regenerated after a restart: their data slots were not marked done)."""
        deadline = asyncio.get_running_loop().time() + flush_s
        while self.pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self._task:
            self._task.cancel()
        for t in list(self._posting):
            t.cancel()

    async def push(self, group: Group, packed: Packed | None = None) -> Outcome:
        """The buffer's answer for ``group`` (``packed``: its arrays, where the loop made them)."""
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((group, fut, packed))
        if 0 < self.eager_groups <= self._queue.qsize() and len(self._posting) < MAX_IN_FLIGHT \
                and self.stats.buffer_up and self._task is not None:
            self._post_now()
        return await fut

    def _post_now(self) -> None:
        """Post what is queued (up to ``batch`` groups), the request written before this returns."""
        items = [self._queue.get_nowait() for _ in range(min(self.batch, self._queue.qsize()))]
        try:
            body = encode_groups([g for g, _, _ in items], [p for _, _, p in items])
        except cols.NotColumnar:   # rows: the task posts them (the buffer's row schema words what is wrong)
            self._start(items)
            return
        self.stats.eager_posts += 1
        self._start(items, (body, self.client.post_columns_now(body)))

    async def _run(self) -> None:
        while True:
            items = [await self._queue.get()]
            self._waiting = 1
            while len(self._posting) >= MAX_IN_FLIGHT:
                self._slot_free.clear()
                await self._slot_free.wait()
            while len(items) < self.batch and not self._queue.empty():   # what queued while waiting
                items.append(self._queue.get_nowait())
            self._waiting = 0
            self._start(items)

    def _start(self, items: list[_Item], started: _Started | None = None) -> None:
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
