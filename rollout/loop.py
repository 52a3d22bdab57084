"""The generation loop: prompt -> n samples (generator) -> rewards -> filter -> buffer.

Guarantees:
- Group ids are ``<run_id>-e<epoch>-g<position>`` and uids ``<group_id>-<index>``: a prompt slot
  regenerated after a crash or a lost answer carries the same ids, so the buffer deduplicates it.
- A data slot is marked done (and the cursor persisted) only after its group reached the buffer,
  was filtered out, or failed entirely; slots in flight at a crash are drawn again after restart.
- A plugin that raises, returns the wrong type or breaks a Sample invariant yields a ``failed``
  sample (reward null, reason in ``metadata["error"]``); the loop keeps running. A group's
  generated samples are checked once, together, as columns (``columns_push.check_outputs``: numpy
  over their tokens, masks and logprobs; the row schema only for a sample it flags), before
  scoring; no per-sample pydantic validation or deep copy on the hot path. The default generator's
  token, mask and logprob lists are not walked a second time: they are the tokenizer's output and
  engine answers the transport checked (``answers.check_answer``); its other fields are. The
  push encodes the arrays of that check (``columns_push.Packed``) while the lists still equal them.
- Each generator call gets its own copy of the prompt sample (fresh lists and free-form
  containers): a generator that mutates its input cannot reach another sample.
- The default generator's groups of at most ``rollout.engines.coalesce_max`` (and ``max_concurrency``)
  samples run as one call (``EngineClient.generate_group``: no task per sample, one routing of
  the group's first requests), with the samples, failures and messages one call per sample gives.
- Rewards: an async reward function runs concurrently with the others of its group, each bounded
  by ``rollout.reward_timeout_s``; a plain ``def`` (the built-ins but ``remote``) is applied inline,
  no task per sample, and the event loop gets a turn between samples once they have held it
  ``REWARD_SLICE_S``. A reward's fault fails its sample only (``rewards.score_now`` /
  ``score_later``).
- Each sample's ``weight_version`` is the oldest version that produced any of its tokens (the
  context tracks it across partial-rollout resumes and multi-turn calls).
- Continuous mode admits a new group only while buffer (queued + leased) + groups in flight here
  < (max_staleness + 1) x groups_per_step; with k services on the buffer (``data.shard``) each
  admits against its share of that cap and of the backlog (``shared.staleness.admits``), so
  together they stay within it while they push at the same pace, and below twice it in any case.
  on_demand mode generates only inside ``generate_batch``; ``AHEAD_AFTER_S`` after a round's first
  draw, while its requests are out, it makes the ids of the prompts the next round will draw
  (``prompts.PromptIds``): on the 2-core machine that took ~0.7 ms off the time to a round's last
  engine request (bench/rollout_bench.py, traced, rounds alternating with and without it).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from headrace.rollout.columns_push import NUMBERS_VALID, Packed, check_outputs, copy_for_generator, short
from headrace.rollout.data import DataSource, PromptItem
from headrace.rollout.filters import FilterFn, apply_filter
from headrace.rollout.generate import EngineClient, GenerateFn, RolloutContext, single_turn, typename
from headrace.rollout.group_path import Made, failed, group_samples
from headrace.rollout.prompts import PromptIds, prompt_ids, prompt_sample
from headrace.rollout.pusher import LINGER_S, Pusher
from headrace.rollout.rewards import RewardFn, drop, score_later, score_now
from headrace.shared.client import AsyncBufferClient
from headrace.shared.config import HeadraceConfig
from headrace.shared.schemas import FAILED, Group, Sample
from headrace.shared.staleness import admission_cap, admits
from headrace.shared.staleness import admission_share as share_of_cap

log = logging.getLogger("headrace.rollout")
REWARD_SLICE_S = 0.002  # plain (sync) rewards run inline; after this long the loop gets a turn between samples

class RolloutLoop:
    """Produces groups into the buffer; owns counters reported by /v1/status."""

    def __init__(self, cfg: HeadraceConfig, data: DataSource, engine: EngineClient, tokenizer: Any,
                 generate_fn: GenerateFn, reward_fn: RewardFn, filter_fn: FilterFn | None,
                 buffer: AsyncBufferClient, run_id: str, http: Any) -> None:
        self.cfg = cfg
        self.rc = cfg.rollout
        self.data = data
        self.engine = engine
        self.gate = engine.gate
        self.tokenizer = tokenizer
        self.generate_fn = generate_fn
        self.reward_fn = reward_fn
        self.filter_fn = filter_fn
        self.buffer = buffer
        self.run_id = run_id
        self.http = http
        self.pusher = Pusher(buffer, self.rc.push_batch, self.rc.push_retry_max_s, LINGER_S[self.rc.mode])
        self.samples_sem = asyncio.Semaphore(self.rc.max_concurrency)
        self._group_lock = asyncio.Lock()
        self._packed: dict[str, Packed] = {}   # group id -> its arrays, until its slot ends
        self.prompts = PromptIds(tokenizer, self.rc.data.apply_chat_template)   # ids made before they are needed
        # rollout.agent: ``await agent(item, group_id)`` -> the group's samples (the gateway's runner)
        self.agent: Callable[[PromptItem, str], Awaitable[list[Sample]]] | None = None
        self.logger = logging.getLogger("headrace.rollout.plugin")
        self.groups_in_flight = 0
        self.producing = 0   # groups in flight not yet queued for the push (nor filtered out, nor failed)
        self.backlog = 0  # buffer queued + leased, from /v1/stats (plus what we pushed since)
        self.counts = {"groups_pushed": 0, "groups_duplicate": 0, "groups_filtered": 0, "groups_failed": 0,
                       "groups_rejected": 0, "samples": 0, "samples_failed": 0, "filter_errors": 0}
        self.started = time.monotonic()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._batch_lock = asyncio.Lock()

    # ---- one group ----

    def _ctx(self, with_engine: bool = True) -> RolloutContext:
        return RolloutContext(self.engine if with_engine else None, self.tokenizer, self.rc, self.logger, self.http)

    async def _generate(self, base: Sample, sampling: dict[str, Any], group_engine: list[Any] | None = None) -> Made:
        """The generator's samples for ``base`` (type-checked only), or ``base`` failed with the
        reason; and how much of them is valid by construction (``Made``)."""
        ctx = self._ctx()
        ctx.group_engine = group_engine
        built = 0
        async with self.samples_sem:
            try:
                given = copy_for_generator(base)
                out = await self.generate_fn(ctx, given, dict(sampling))
                outs = out if isinstance(out, list) else [out]
                if not outs or not all(isinstance(s, Sample) for s in outs):
                    raise TypeError(f"generator must return a Sample or a list of Samples, got {typename(out)}")
                # the default generator appends one checked engine answer to the tokenized prompt
                built = NUMBERS_VALID if self.generate_fn is single_turn and out is given else 0
            except ValidationError as e:  # the generator built a Sample that breaks the schema
                outs = [failed(base, f"generator produced an invalid sample: {short(e)}")]
            except Exception as e:  # noqa: BLE001 - a generator fault fails the sample only
                self.logger.warning("generator failed for %s: %s: %s", base.uid, type(e).__name__, e)
                outs = [failed(base, f"generate: {type(e).__name__}: {e}")]
        return ctx, base, outs, built

    async def _generate_group(self, first: Sample, n: int, sampling: dict[str, Any], cell: list[Any]) -> list[Made]:
        """``_generate`` for the ``n`` samples of a group of the default generator at once (``first``:
        sample 0's prompt sample): one routed batch of first requests (``EngineClient.generate_group``),
        no task per sample, and each sample one copy of ``first`` (ids, its own label and metadata,
        the answer appended: ``group_path.group_samples``) instead of a prompt sample, a copy for
        the generator and the appending. The same samples, failures and messages as ``_generate`` gives each; the group
        holds ``n`` of ``rollout.max_concurrency`` while it runs (taken together under a lock, so
        two groups never wait on each other's half)."""
        gid = first.group_id
        ctxs = [self._ctx() for _ in range(n)]
        for c in ctxs:
            c.group_engine = cell
        async with self._group_lock:
            taken = 0
            try:
                while taken < n:
                    await self.samples_sem.acquire()
                    taken += 1
            except BaseException:
                for _ in range(taken):
                    self.samples_sem.release()
                raise
        try:
            answers = await self.engine.generate_group(ctxs, first.tokens, sampling)   # (read only)
        except Exception as e:  # noqa: BLE001 - as a generator fault: each sample fails, the group goes on
            answers = [e] * n
        finally:
            for _ in range(n):
                self.samples_sem.release()
        packed = self._packed.setdefault(gid, Packed(first.tokens))   # the push's arrays (columns_push)
        return group_samples(first, ctxs, answers, self.gate.version, packed, self.logger)

    async def _finish(self, made: list[Made]) -> list[Sample]:
        """Check every generated sample at once (invalid ones fail with the schema's message), tag
        versions, score; samples in order."""
        seen: set[int] = set()
        flat: list[tuple[RolloutContext, Sample, Sample]] = []
        built: list[int] = []
        for ctx, base, outs, numbers_valid in made:
            for s in outs:
                if id(s) in seen:  # one object returned twice: each place gets its own sample
                    s = s.model_copy(deep=True)
                seen.add(id(s))
                flat.append((ctx, base, s))
                built.append(numbers_valid)
        todo = [(k, s) for k, (_, _, s) in enumerate(flat) if s.status != FAILED]
        samples = [s for _, _, s in flat]
        for (k, _), (ok, why) in zip(todo, check_outputs([s for _, s in todo], [built[k] for k, _ in todo])):
            samples[k] = ok if ok is not None else failed(flat[k][1], f"generator produced an invalid sample: {why}")
        scoring: list[Any] = []
        since = time.perf_counter()
        try:
            for (ctx, _, _), s in zip(flat, samples):
                v = ctx.weight_version if ctx.weight_version is not None else self.gate.version
                if s.weight_version != v:   # (the default generator's group samples are built with it)
                    s.weight_version = v
                if s.status != FAILED:
                    pending = score_now(self.reward_fn, ctx, s)
                    if pending is not None:   # an async reward: those of the group run concurrently
                        scoring.append((pending, ctx, s))
                    elif time.perf_counter() - since > REWARD_SLICE_S:   # slow plain rewards: let the loop in
                        await asyncio.sleep(0)
                        since = time.perf_counter()
        except asyncio.CancelledError:
            for pending, _, _ in scoring:   # cancelled while yielding: these will never be awaited
                drop(pending)
            raise
        if scoring:
            timeout = self.rc.reward_timeout_s
            await asyncio.gather(*(score_later(p, ctx, s, timeout) for p, ctx, s in scoring))
        return samples

    async def _sample(self, base: Sample, sampling: dict[str, Any]) -> list[Sample]:
        return await self._finish([await self._generate(base, sampling)])

    async def produce(self, item: PromptItem, sampling: dict[str, Any] | None = None) -> Group | None:
        """Generate and score one group for ``item`` (None when every sample failed)."""
        gid = self._gid(item)
        n = self.rc.n_samples_per_prompt
        proto = dict(group_id=gid, label=item.label, metadata=dict(item.metadata), weight_version=self.gate.version)
        try:
            ids, text = self.prompts.take(item)
            why = None
            if self.rc.max_prompt_length and len(ids) > self.rc.max_prompt_length:
                why = f"prompt has {len(ids)} tokens > rollout.max_prompt_length {self.rc.max_prompt_length}"
        except Exception as e:  # noqa: BLE001 - a bad prompt fails its group only
            ids, text, why = [], str(item.prompt)[:2000], f"tokenizing the prompt: {type(e).__name__}: {e}"
        first = prompt_sample(uid=f"{gid}-0", index=0, tokens=ids, prompt=text, **proto)
        params = sampling or self.rc.sampling.to_sglang()
        shared: list[Any] = [None]   # one engine for the group while it is not much busier (generate.py)
        numbered = not why and self.agent is None and self.generate_fn is single_turn and self.engine is not None \
            and 1 < n <= min(self.rc.max_concurrency, self.engine.transport.max_batch)
        if numbered:   # (its samples come with their ids)
            samples = await self._finish(await self._generate_group(first, n, params, shared))
        else:
            bases = [first] + [first.model_copy(update={"uid": f"{gid}-{i}", "index": i}) for i in range(1, n)]
            if why:
                samples = [failed(b, why) for b in bases]
            elif self.agent is not None:
                samples = await self.agent(item, gid)
            else:
                samples = await self._finish(await asyncio.gather(*(self._generate(b, params, shared) for b in bases)))
        if not numbered:   # generators may return several samples: renumber
            for i, s in enumerate(samples):
                uid = f"{gid}-{i}"
                if type(s.index) is not int or s.index != i or s.uid != uid or s.group_id != gid:   # (model sets cost)
                    s.index, s.uid, s.group_id = i, uid, gid
        lost = sum(s.status == FAILED for s in samples)
        self.counts["samples"] += len(samples)
        self.counts["samples_failed"] += lost
        if lost == len(samples):
            log.warning("group %s: every sample failed (%s)", gid, samples[0].metadata.get("error"))
            return None
        return Group(group_id=gid, samples=samples, metadata={"epoch": item.epoch, "position": item.position})

    def _gid(self, item: PromptItem) -> str:
        return f"{self.run_id}-{item.key}"

    async def _run_slot(self, item: PromptItem) -> bool:
        """Produce, filter and push one slot; True when a group reached the buffer as new."""
        self.groups_in_flight += 1
        try:
            return await self._slot(item)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not stop the loop or spin it
            log.exception("group for slot %s failed: %s", item.key, e)
            self.counts["groups_failed"] += 1
            self.data.mark_done(item)
            await asyncio.sleep(1.0)
            return False
        finally:
            self.groups_in_flight -= 1
            self._packed.pop(self._gid(item), None)
            self.prompts.drop(item)
            self._wake.set()

    async def _slot(self, item: PromptItem) -> bool:
        """Produce -> filter -> push; the slot is marked done once its group's fate is final. When
        no other group is left in production, the pusher posts what it holds (``Pusher.flush``)."""
        self.producing += 1
        try:
            group = await self.produce(item)
            if group is None:
                self.counts["groups_failed"] += 1
                self.data.mark_done(item)
                return False
            keep, err = apply_filter(self.filter_fn, self._ctx(False), group)
            if err:
                self.counts["filter_errors"] += 1
                group.metadata["filter_error"] = err
            if not keep:
                self.counts["groups_filtered"] += 1
                self.data.mark_done(item)
                return False
            pushed = self.pusher.enqueue(group, self._packed.get(group.group_id))
        finally:
            self.producing -= 1
            if self.producing == 0:
                self.pusher.flush()
        outcome = await pushed
        self.data.mark_done(item)
        key = {"accepted": "groups_pushed", "duplicate": "groups_duplicate", "rejected": "groups_rejected"}[outcome]
        self.counts[key] += 1
        if outcome == "accepted":
            self.backlog += 1
        return outcome != "rejected"

    def _spawn(self, item: PromptItem) -> asyncio.Task[bool]:
        t = asyncio.create_task(self._run_slot(item))
        self._tasks.add(t)
        t.add_done_callback(self._done)
        return t

    def _done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("group task crashed: %r", t.exception(), exc_info=t.exception())

    # ---- modes ----

    @property
    def admission_cap(self) -> int:
        return admission_cap(self.cfg.buffer.max_staleness, self.rc.groups_per_step)

    @property
    def _shard(self) -> tuple[int, int, list[int] | None]:
        """(index, count, weights) of this service among those sharing the buffer (``rollout.data.shard``)."""
        shard = self.rc.data.shard
        return (shard.index, shard.count, shard.weights) if shard is not None else (0, 1, None)

    @property
    def admission_share(self) -> int:
        """This service's share of ``admission_cap`` (all of it unless the buffer is shared)."""
        return share_of_cap(self.admission_cap, *self._shard)

    async def poll_stats(self) -> None:
        """Keep ``backlog`` = buffer queued + leased-not-held (continuous mode's admission input)."""
        while True:
            try:
                # Pushes that land while the stats request is in flight may or may not be counted
                # by it: add them anyway, so the figure errs high and admission never overshoots.
                before = self.counts["groups_pushed"]
                st = await self.buffer.stats()
                self.backlog = st.queued + st.leased - st.held + (self.counts["groups_pushed"] - before)
                self._wake.set()
            except Exception as e:  # noqa: BLE001 - buffer down: keep the last figure
                log.debug("buffer stats unavailable: %s", e)
            await asyncio.sleep(self.rc.stats_interval_s)

    async def continuous(self) -> None:
        """Generate ahead while the admission rule allows; pause stops admitting."""
        while True:
            await self.gate.wait_open()
            if not admits(self.backlog, self.groups_in_flight, self.admission_cap, *self._shard):
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.rc.stats_interval_s)
                except asyncio.TimeoutError:
                    pass
                continue
            item = self.data.next()
            if item is None:
                log.info("data exhausted after %s epochs; generation stops", self.rc.data.epochs)
                return
            self._spawn(item)
            await asyncio.sleep(0)

    async def generate_batch(self, n: int) -> dict[str, Any]:
        """on_demand: return once ``n`` new groups passed the filter and are in the buffer
        (or the data / over-sampling budget ran out: ``n * max_oversample`` prompts)."""
        async with self._batch_lock:
            t0 = time.monotonic()
            pushed = drawn = 0
            limit = n * self.rc.max_oversample
            running: set[asyncio.Task[bool]] = set()
            exhausted = False
            while pushed < n:
                items: list[PromptItem] = []
                while not exhausted and len(running) + len(items) + pushed < n and drawn < limit:
                    item = self.data.next()
                    if item is None:
                        exhausted = True
                        break
                    items.append(item)
                    drawn += 1
                self.prompts.for_round(items)
                running.update(self._spawn(item) for item in items)
                if items and drawn == len(items) and AHEAD_AFTER_S:   # (the round's first draw)
                    asyncio.get_running_loop().call_later(AHEAD_AFTER_S, self._ahead, n)
                if not running:
                    break
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                pushed += sum(1 for t in done if not t.cancelled() and t.exception() is None and t.result())
            return {"groups": pushed, "requested": n, "prompts_drawn": drawn, "complete": pushed >= n,
                    "data_exhausted": exhausted, "seconds": round(time.monotonic() - t0, 3)}

    def _ahead(self, n: int) -> None:
        try:
            self.prompts.ahead(self.data.peek(n))
        except Exception as e:  # noqa: BLE001 - only a cache: the round tokenizes what it lacks
            log.warning("making the next round's prompt ids ahead failed: %s: %s", type(e).__name__, e)

    async def evaluate(self, limit: int | None = None, part: tuple[int, int] | None = None) -> dict[str, Any]:
        """One sample per held-out prompt with ``eval_sampling`` (greedy by default), scored; nothing
        is pushed. ``score`` is pass@1 (reward >= 1), ``reward_mean`` the mean reward (failed = 0).
        ``part`` (i, k): only prompts i, i + k, ... of the first ``limit`` (one of k services' share;
        each keeps its position, hence its uid); a part with no prompt answers ``n`` 0."""
        from headrace.rollout.data import load_items

        everything = load_items(self.rc.data, eval=True)
        if not everything:
            raise ValueError("no evaluation prompts: set rollout.data.eval_path or use a data.task")
        first, step = part or (0, 1)
        indexed = list(enumerate(everything[: limit or None]))[first::step]
        if not indexed:
            return {"n": 0, "score": 0.0, "pass_at_1": 0.0, "reward_mean": 0.0, "failed": 0,
                    "weight_version": self.gate.version}
        sampling = self.rc.eval_sampling.to_sglang()

        async def one(i: int, triple: tuple[Any, Any, dict[str, Any]]) -> Sample:
            item = PromptItem(position=i, epoch=0, prompt=triple[0], label=triple[1], metadata=triple[2])
            ids, text = prompt_ids(self.tokenizer, item, self.rc.data.apply_chat_template)   # (not a round's)
            base = prompt_sample(uid=f"eval-{i}", group_id=f"eval-{i}", tokens=ids, prompt=text, label=item.label,
                                 metadata={}, weight_version=self.gate.version)
            return (await self._sample(base, sampling))[0]

        samples = await asyncio.gather(*(one(i, t) for i, t in indexed))
        rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
        mean = sum(rewards) / len(rewards)
        pass1 = sum(r >= 1.0 for r in rewards) / len(rewards)
        return {"n": len(samples), "score": pass1, "pass_at_1": pass1, "reward_mean": mean,
                "failed": sum(s.status == FAILED for s in samples),
                "weight_version": min((s.weight_version for s in samples), default=self.gate.version)}

    async def flush_cursor(self) -> None:
        """Persist the data cursor every 0.2 s when it moved (one atomic rename, not one per group);
        collect cyclic garbage every ``GC_EVERY_S`` (``start``: the threshold alone may never come).
        Neither while a ``generate_batch`` round runs, for up to ``QUIET_IN_BATCH_S`` (a write cost
        ~0.5 ms of the service's time per 32-group round of bench/rollout_bench.py; a later crash
        only regenerates slots, which the buffer dedupes)."""
        last_gc = last = time.monotonic()
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            if self._batch_lock.locked() and now - last < QUIET_IN_BATCH_S:
                continue
            self.data.flush()
            last = now
            last_gc = collect_garbage(last_gc, now)

    def start(self) -> None:
        # Everything loaded so far (libraries, tokenizer, config) lives as long as the service: out of
        # the cyclic GC's reach, or every full collection walks those millions of objects again. A
        # batch /generate answer is ~66k lists that die within a few loop turns; with the default
        # threshold (700 net new containers) a collection walks each while it lives. The count is net:
        # with hundreds of 8 x 2,048-token groups in flight even 2M was reached three times a fleet_sim
        # run (~280 ms each); at GC_THRESHOLD none came and the CPU per group fell 5-9% (bench/RESULTS.md).
        # Cyclic garbage (rare here) goes at the next collection, at the latest at the full one
        # ``flush_cursor`` runs every ``GC_EVERY_S``.
        gc.freeze()
        gc.set_threshold(max(gc.get_threshold()[0], GC_THRESHOLD), *gc.get_threshold()[1:])
        self.pusher.start()
        self.data.autosave = False
        for coro in [self.flush_cursor()] + ([self.poll_stats(), self.continuous()]
                                             if self.rc.mode == "continuous" else []):
            t = asyncio.create_task(coro)
            self._tasks.add(t)
            t.add_done_callback(self._done)

    async def stop(self) -> None:
        await self.pusher.stop()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.data.flush()


GC_THRESHOLD = 10_000_000   # the cyclic GC's first threshold while the loop runs (``RolloutLoop.start``)
GC_EVERY_S = 30.0           # and a full collection this often, whatever the threshold saw
AHEAD_AFTER_S = 0.01   # generate_batch makes the next round's prompt ids this long after its start (0: never),
#                        while its requests are out (prompts.PromptIds)
QUIET_IN_BATCH_S = 10.0     # how long ``flush_cursor`` may skip its work while a generate_batch runs


def collect_garbage(last: float, now: float) -> float:
    """A full ``gc.collect()`` when ``GC_EVERY_S`` passed since ``last``; the time of the last one."""
    if now - last < GC_EVERY_S:
        return last
    gc.collect()
    return now
