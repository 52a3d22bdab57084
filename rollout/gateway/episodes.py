"""Episodes: open, record, finish, group and push (DESIGN.md "Agent gateway").

Guarantees:
- An episode's key is a fresh random secret; only its SHA-256 is kept, and it authenticates the
  OpenAI calls of that episode alone, while the episode is open (finished or unknown: 401).
- Calls of one episode are serialized (one lock per episode): prefix matching sees them in order.
- Finishing turns every segment into a Sample: with a reward, each segment gets it; without, the
  configured reward function scores each segment; an episode with no call, or one idle for
  ``rollout.gateway.episode_timeout_s``, is finished as ``failed`` (reward null). A segment whose last
  call ended by length is ``truncated``.
- Episodes sharing a ``group_id`` form one group, pushed to the buffer (through the rollout loop's
  pusher) once ``group_size`` of them are finished; the group_id is kept verbatim; label and
  metadata are copied to the samples. A group whose samples all failed is not pushed (counted).
- Samples of one group share their prompt (the trainer requires it): a group's samples are split at
  the longest common prefix of their segments' prompts; tokens after it that no completion
  produced carry loss_mask 0.
- Episodes run by in-service agents (``managed=False``) are not grouped here: the agent runner
  collects their samples and the loop pushes the group like a generator's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from headrace.rollout.columns_push import check_outputs
from headrace.rollout.gateway.openai_api import ApiError
from headrace.rollout.gateway.recording import Segment
from headrace.rollout.generate import RolloutContext
from headrace.rollout.rewards import RewardFn, score_sample
from headrace.shared.schemas import Group, Sample, SampleStatus

log = logging.getLogger("headrace.rollout.gateway")

MAX_OPEN = 100_000   # episodes open at once; beyond, POST /v1/episodes is a 429
KEY_PREFIX = "hr-ep-"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class EpisodeContext(RolloutContext):
    """The engine-call context of one episode: ``pinned_engine`` keeps its calls on one engine."""

    pinned_engine: Any = None


@dataclass
class Episode:
    id: str
    group_id: str
    group_size: int
    label: Any
    metadata: dict[str, Any]
    managed: bool
    ctx: EpisodeContext
    key_hash: str = ""
    state: str = "open"                            # open | finished | failed
    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    last_active: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def view(self) -> dict[str, Any]:
        return {"episode_id": self.id, "group_id": self.group_id, "state": self.state, "calls": self.calls,
                "segments": [s.view() for s in self.segments]}


@dataclass
class _Pending:
    size: int
    episodes: list[Episode] = field(default_factory=list)


def _invalid(s: Sample, why: str) -> Sample:
    """``s`` failed with the reason, its response dropped; its label too when that is what is invalid."""
    fields = dict(uid=s.uid, group_id=s.group_id, tokens=[], status=SampleStatus.failed,
                  weight_version=s.weight_version, metadata={"error": why})
    try:
        return Sample(label=s.label, **fields)
    except ValidationError:
        return Sample(**fields)


class EpisodeStore:
    """Every open or finished-but-unpushed episode; pushes complete groups."""

    def __init__(self, tokenizer: Any, reward_fn: RewardFn, ctx_factory: Callable[[], EpisodeContext],
                 push: Callable[[Group], Awaitable[str]], run_id: str, timeout_s: float,
                 reward_timeout_s: float, version: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.ctx_factory = ctx_factory
        self.push = push
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.reward_timeout_s = reward_timeout_s
        self.version = version
        self.episodes: dict[str, Episode] = {}
        self.by_key: dict[str, Episode] = {}
        self.pending: dict[str, _Pending] = {}
        self.counts = {"episodes_opened": 0, "episodes_finished": 0, "episodes_failed": 0, "episodes_timed_out": 0,
                       "calls": 0, "refused_calls": 0, "prefix_breaks": 0, "groups_pushed": 0,
                       "groups_duplicate": 0, "groups_rejected": 0, "groups_failed": 0}
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- lifecycle ----

    def open(self, group_id: str | None = None, group_size: int = 1, label: Any = None,
             metadata: dict[str, Any] | None = None, managed: bool = True) -> tuple[Episode, str]:
        if sum(e.state == "open" for e in self.episodes.values()) >= MAX_OPEN:
            raise ApiError(429, f"{MAX_OPEN} episodes are open; finish some first")
        gid = group_id or f"{self.run_id}-ep-{secrets.token_hex(8)}"
        if managed:
            pend = self.pending.get(gid)
            if pend is None:
                self.pending[gid] = pend = _Pending(group_size)
            elif pend.size != group_size:
                raise ApiError(409, f"group {gid!r} was opened with group_size {pend.size}, not {group_size}")
            if len(pend.episodes) >= pend.size:
                raise ApiError(409, f"group {gid!r} already has its {pend.size} episodes")
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        ep = Episode(id="ep-" + secrets.token_hex(12), group_id=gid, group_size=group_size, label=label,
                     metadata=dict(metadata or {}), managed=managed, ctx=self.ctx_factory(), key_hash=key_hash(key))
        self.episodes[ep.id] = ep
        self.by_key[ep.key_hash] = ep
        if managed:
            self.pending[gid].episodes.append(ep)
        self.counts["episodes_opened"] += 1
        return ep, key

    def authenticate(self, authorization: str | None) -> Episode:
        scheme, _, key = (authorization or "").partition(" ")
        ep = self.by_key.get(key_hash(key.strip())) if scheme.lower() == "bearer" else None
        if ep is None or ep.state != "open":
            raise ApiError(401, "unknown or finished episode: use the api_key POST /v1/episodes answered")
        return ep

    def get(self, episode_id: str) -> Episode:
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise ApiError(404, f"no episode {episode_id!r} (unknown, or its group was already pushed)")
        return ep

    async def finish(self, ep: Episode, reward: float | None = None, error: str | None = None) -> Episode:
        """Finish ``ep`` (idempotent: a finished episode is answered as it is)."""
        async with ep.lock:
            if ep.state != "open":
                return ep
            if not ep.segments and error is None:
                error = "the episode made no call"
            ep.state = "failed" if error else "finished"
            ep.error = error
            self.by_key.pop(ep.key_hash, None)
            ep.samples = await self._samples(ep, reward)
            self.counts["episodes_failed" if error else "episodes_finished"] += 1
            ep.done.set()
        if ep.managed:
            pend = self.pending.get(ep.group_id)
            if pend and len(pend.episodes) == pend.size and all(e.state != "open" for e in pend.episodes):
                del self.pending[ep.group_id]
                self._spawn(self._push_group(ep.group_id, pend.episodes))
        else:
            self.episodes.pop(ep.id, None)
        return ep

    async def _samples(self, ep: Episode, reward: float | None) -> list[Sample]:
        fields = dict(label=ep.label, metadata={**ep.metadata, "episode_id": ep.id})
        version = self.version()
        if not ep.segments:
            return [Sample(uid=f"{ep.id}-0", group_id=ep.group_id, tokens=[], status=SampleStatus.failed,
                           weight_version=version, label=ep.label,
                           metadata={**fields["metadata"], "error": ep.error or "no call"})]
        out = []
        for i, seg in enumerate(ep.segments):
            s = seg.sample(f"{ep.id}-{i}", ep.group_id, i, version, self.tokenizer, **fields)
            s.metadata = {**s.metadata, "segment": i}
            if ep.error:
                s.status, s.metadata["error"] = SampleStatus.failed.value, ep.error
            elif reward is not None:
                s.reward = float(reward)
            else:
                await score_sample(self.reward_fn, ep.ctx, s, self.reward_timeout_s)
            out.append(s)
        # the row schema's check, as the loop checks a generator's samples (numbers in one numpy pass)
        return [ok if ok is not None else _invalid(s, f"invalid sample: {why[:500]}")
                for s, (ok, why) in zip(out, check_outputs(out))]

    async def _push_group(self, gid: str, episodes: list[Episode]) -> None:
        samples = group_samples(gid, [s for e in episodes for s in e.samples])
        try:
            if all(s.status == SampleStatus.failed.value for s in samples):
                self.counts["groups_failed"] += 1
                log.warning("group %s: every episode failed (%s); not pushed", gid, samples[0].metadata.get("error"))
                return
            outcome = await self.push(Group(group_id=gid, samples=samples, metadata={"source": "gateway"}))
            self.counts[{"accepted": "groups_pushed", "duplicate": "groups_duplicate"}.get(outcome, "groups_rejected")] += 1
        finally:
            for e in episodes:
                self.episodes.pop(e.id, None)

    # ---- idle timeout ----

    async def sweep(self, interval_s: float = 1.0) -> None:
        """Finish episodes idle for longer than the timeout as failed."""
        while True:
            await asyncio.sleep(min(interval_s, self.timeout_s / 4))
            now = time.monotonic()
            for ep in list(self.episodes.values()):
                if ep.state == "open" and not ep.lock.locked() and now - ep.last_active > self.timeout_s:
                    self.counts["episodes_timed_out"] += 1
                    await self.finish(ep, error=f"idle for more than rollout.gateway.episode_timeout_s "
                                                f"({self.timeout_s:g} s)")

    def start(self) -> None:
        self._spawn(self.sweep())

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def status(self) -> dict[str, Any]:
        return {"episodes_open": sum(e.state == "open" for e in self.episodes.values()),
                "episodes_held": len(self.episodes), **self.counts}


def group_samples(gid: str, samples: list[Sample]) -> list[Sample]:
    """Number the samples of one group and split them at their common prompt (see the module doc)."""
    usable = [s for s in samples if s.status != SampleStatus.failed.value]
    common = min((s.prompt_length for s in usable), default=0)
    for s in usable[1:]:
        first = usable[0].tokens
        n = 0
        while n < common and s.tokens[n] == first[n]:
            n += 1
        common = n
    out = []
    for i, s in enumerate(samples):
        upd: dict[str, Any] = {"index": i, "uid": f"{gid}-{i}", "group_id": gid}
        if s.status != SampleStatus.failed.value and common and s.prompt_length > common:
            moved = s.prompt_length - common
            upd.update(response_length=s.response_length + moved, loss_mask=[0] * moved + s.loss_mask,
                       rollout_logprobs=[0.0] * moved + (s.rollout_logprobs or []))
        out.append(s.model_copy(update=upd))
    return out
