"""The rollout pusher against a buffer endpoint on loopback (real HTTP, real columnar bodies).

The endpoint is a minimal HTTP server in this process that answers ``POST /v1/groups`` like the
buffer (``{"accepted", "duplicates"}``) after a delay, and records every body it decodes and how
many requests it held at once: enough to see the pusher's batching and its posts in flight, which a
real buffer answers too fast to observe.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest

from headrace.rollout.pusher import Pusher
from headrace.shared import columns as cols
from headrace.shared.client import AsyncBufferClient
from headrace.shared.schemas import Group
from tests.trainer.support import make_groups


class SlowBuffer:
    """``POST /v1/groups`` answered after ``delay_s``; group ids per request and peak concurrency."""

    def __init__(self, delay_s: float, fail: int = 0) -> None:
        self.delay_s = delay_s
        self.fail = fail   # the first ``fail`` requests are answered 503, nothing recorded
        self.refused: list[list[str]] = []
        self.requests: list[list[str]] = []
        self.held = self.peak = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):   # the client closed its connection
                break
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            columns, _ = cols.decode(await reader.readexactly(length))
            self.held += 1
            self.peak = max(self.peak, self.held)
            await asyncio.sleep(self.delay_s)
            self.held -= 1
            if len(self.refused) < self.fail:
                self.refused.append(list(columns.group_id))
                status, body = b"503 Service Unavailable", b'{"detail": "busy"}'
            else:
                self.requests.append(list(columns.group_id))
                status = b"200 OK"
                body = json.dumps({"accepted": len(columns.group_id), "duplicates": 0}).encode()
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        writer.close()


@asynccontextmanager
async def pusher_to(buffer: SlowBuffer, **kw: Any) -> AsyncIterator[Pusher]:
    """A started ``Pusher`` (``kw``: its own arguments and the client's) posting to ``buffer``
    served on loopback; stopped, and everything closed, on exit."""
    server = await asyncio.start_server(buffer.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AsyncBufferClient(f"http://127.0.0.1:{port}", retries=kw.pop("retries", 0),
                               backoff_s=kw.pop("backoff_s", 0.2))
    pusher = Pusher(client, batch=kw.pop("batch", 64), retry_max_s=1.0, **kw)
    pusher.start()
    try:
        yield pusher
    finally:
        await pusher.stop()
        await client.close()
        server.close()
        await server.wait_closed()


def test_a_lone_first_group_does_not_hold_back_the_groups_queued_behind_it() -> None:
    """``push`` (the agent gateway's): posted on the pusher's next turn, no lingering."""
    groups = [Group.model_validate(g) for g in make_groups(n_groups=25, size=2, seed=4)]

    async def run() -> tuple[SlowBuffer, list[str], int]:
        buffer = SlowBuffer(delay_s=0.3)
        async with pusher_to(buffer) as pusher:
            first = asyncio.create_task(pusher.push(groups[0]))
            await asyncio.sleep(0.05)        # the first group is on its way alone
            second = asyncio.create_task(pusher.push(groups[1]))
            await asyncio.sleep(0.05)        # so is the second: two posts in flight
            rest = [asyncio.create_task(pusher.push(g)) for g in groups[2:]]
            await asyncio.sleep(0.05)
            pending = pusher.pending         # queued behind two posts, all counted
            outcomes = await asyncio.gather(first, second, *rest)
            assert pusher.pending == 0
        return buffer, outcomes, pending

    buffer, outcomes, pending = asyncio.run(run())
    assert outcomes == ["accepted"] * len(groups)
    assert pending == len(groups)
    ids = [g for r in buffer.requests for g in r]
    assert sorted(ids) == sorted(g.group_id for g in groups)          # each group exactly once
    # the first two went alone, each as soon as it was pushed; everything queued meanwhile went as
    # one batch, at once (a post was free)
    assert [len(r) for r in buffer.requests] == [1, 1, len(groups) - 2] and buffer.peak == 3


def test_the_loops_groups_wait_for_a_flush_a_full_batch_or_the_linger() -> None:
    """``enqueue`` (the loop's groups): held while more are coming; a flush posts them together,
    written at once; a full batch goes at once; what no flush follows goes after ``linger_s``."""
    groups = [Group.model_validate(g) for g in make_groups(n_groups=14, size=2, seed=6)]

    async def run() -> tuple[SlowBuffer, dict, list[list[str]], list[list[str]]]:
        buffer = SlowBuffer(delay_s=0.01)
        async with pusher_to(buffer, batch=4, linger_s=0.4) as pusher:
            futs = []
            for g in groups[:3]:                 # one at a time, as a round's groups are built
                futs.append(pusher.enqueue(g))
                await asyncio.sleep(0.02)
            assert buffer.requests == [] and pusher.pending == 3    # held: more are coming
            pusher.flush()                       # the last group of the round is queued
            assert pusher.stats.eager_posts == 1 and pusher.pending == 3
            assert await asyncio.gather(*futs) == ["accepted"] * 3
            after_flush = list(buffer.requests)
            await asyncio.sleep(0.3)             # (the linger counts from each batch's first group)
            futs = [pusher.enqueue(g) for g in groups[3:12]]   # 9 in one turn: two full batches at once
            assert pusher.stats.eager_posts == 3 and pusher.pending == 9
            await asyncio.gather(*futs[:8])
            await asyncio.sleep(0.2)
            assert not futs[8].done()            # the ninth waits for company ...
            futs += [pusher.enqueue(g) for g in groups[12:]]
            await asyncio.gather(*futs)          # ... and goes with the next two after the linger
            stats = dict(vars(pusher.stats))
        return buffer, stats, after_flush, list(buffer.requests)

    buffer, stats, after_flush, requests = asyncio.run(run())
    ids = [g.group_id for g in groups]
    assert after_flush == [ids[:3]]
    assert requests == [ids[:3], ids[3:7], ids[7:11], ids[11:]]
    assert stats["posts"] == 4 and stats["eager_posts"] == 3 and stats["accepted"] == len(groups)


def test_a_push_posted_at_once_that_fails_is_posted_again_and_stored_once() -> None:
    """The first attempt of a flushed batch answered 503: the retrying client posts the same
    groups again; every group is answered, and stored exactly once."""
    groups = [Group.model_validate(g) for g in make_groups(n_groups=8, size=2, seed=5)]

    async def run() -> tuple[SlowBuffer, list[str], dict]:
        buffer = SlowBuffer(delay_s=0.01, fail=1)
        async with pusher_to(buffer, retries=3, backoff_s=0.01) as pusher:
            await asyncio.sleep(0)
            futs = [pusher.enqueue(g) for g in groups]
            pusher.flush()
            outcomes = await asyncio.gather(*futs)
            stats = dict(vars(pusher.stats))
        return buffer, outcomes, stats

    buffer, outcomes, stats = asyncio.run(run())
    assert outcomes == ["accepted"] * len(groups)
    assert stats["eager_posts"] == 1 and stats["accepted"] == len(groups)
    assert buffer.refused == [[g.group_id for g in groups]]      # the first attempt, refused whole
    assert [g for r in buffer.requests for g in r] == [g.group_id for g in groups]   # then stored once
