"""RolloutContext, routed engine calls with partial-rollout resume, and the default generator.

Generator contract (DESIGN.md):
``async def generate(ctx: RolloutContext, sample: Sample, sampling: dict) -> Sample | list[Sample]``.
The sample's ``tokens`` hold the prompt and ``response_length`` is 0; the generator appends the
response (tokens, response_length, loss_mask, rollout_logprobs, status). ``append_turn`` and
``append_tokens`` below do the bookkeeping for multi-turn / tool-calling generators.

Guarantees of ``ctx.generate(input_ids, sampling)``:
- one routed SGLang ``/generate`` answer for one sequence, ``{"text", "output_ids", "meta_info":
  {"finish_reason", "output_token_logprobs", "prompt_tokens", "completion_tokens", ...}}``;
- it waits while the service is paused; a request aborted by ``/v1/pause {"mode":"abort"}`` keeps
  its partial tokens and logprobs and continues after resume with the remaining token budget, so the
  caller sees one answer (a partial rollout); ``meta_info["segments"]`` counts the engine answers
  that contributed tokens (an abort before the first token is a plain retry, not a resume);
- the samples of one group share an engine (the least busy when the group's first request goes)
  while it is routable and has fewer than one batch (``coalesce_max``) more requests in flight than
  the least busy engine: batches hold whole groups, and a group is done when its engine is;
- ``EngineClient.generate_group`` (the default generator's groups of at most ``coalesce_max``
  samples) gives each sample what ``generate`` would, with the group's first requests routed and
  queued together (one engine, as the rule above puts them) and no task per sample: on the 2-core
  machine ~4% more groups/s through the service at 16 tokens (bench/rollout_bench.py); its long
  answers may be compact (``answers.Answer``: logprobs as a list and arrays, no SGLang entries,
  which nothing on that path reads; ``entries_of`` builds them);
- a request whose engine fails (connection lost, 5xx, garbage answer) is retried on another engine;
  4xx answers and exhausted retries raise ``EngineError`` (the sample becomes ``failed``);
- ``ctx.weight_version`` afterwards is the oldest weight version that produced any of its tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import httpx

from headrace.rollout.answers import Answer, EngineError, Retryable, entries_of, logprobs_of, make_entries
from headrace.rollout.transport import Transport, one_sequence
from headrace.shared.config import RolloutConfig
from headrace.shared.schemas import Sample, SampleStatus

__all__ = ["EngineError", "Gate", "EngineClient", "RolloutContext", "append_turn", "append_tokens", "check_generator",
           "single_turn", "turn_fields", "typename"]

if TYPE_CHECKING:
    from headrace.rollout.fleet import Engine, Fleet
    from headrace.rollout.router import Router

GenerateFn = Callable[["RolloutContext", Sample, dict[str, Any]], Awaitable["Sample | list[Sample]"]]

MAX_ATTEMPTS = 50  # connection failures (an engine died: reroute while the fleet restarts it)
MAX_BAD_ANSWERS = 3  # 5xx or unusable bodies: the engine is up but broken


class Gate:
    """Pause state shared by every engine call: closed while paused; counts requests in flight."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.paused = False
        self.abort_epoch = 0
        self.in_flight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        self.paused = True
        self._open.clear()

    def open(self, version: int | None = None) -> None:
        if version is not None:
            self.version = version
        self.paused = False
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def enter(self, k: int = 1) -> None:
        self.in_flight += k
        self._idle.clear()

    def leave(self, k: int = 1) -> None:
        self.in_flight -= k
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class EngineClient:
    """Routed /generate calls shared by all contexts; counts produced tokens."""

    def __init__(self, fleet: "Fleet", router: "Router", gate: Gate, timeout_s: float,
                 coalesce_s: float = 0.0, coalesce_max: int = 1) -> None:
        self.fleet = fleet
        self.router = router
        self.gate = gate
        self.timeout_s = timeout_s
        self.transport = Transport(fleet.http, timeout_s, coalesce_s, coalesce_max)
        self.tokens_out = 0
        self.partial_held = 0  # aborted requests holding partial tokens, waiting for resume

    async def _once(self, input_ids: list[int], params: dict[str, Any],
                    ctx: Any = None) -> tuple[dict[str, Any], int]:
        """One attempt; returns (answer, version that produced it). Raises httpx errors / EngineError.
        A context with a ``pinned_engine`` attribute (an agent-gateway episode) keeps to that engine
        while it is routable (its prefix cache holds the trajectory); one with a ``group_engine``
        cell (a group's samples) shares that engine while it is routable and has fewer than one
        batch (``coalesce_max``) more requests in flight than the least busy engine."""
        engine = await self._route(ctx)
        version = self.gate.version
        engine.in_flight += 1
        self.gate.enter()
        try:
            out = await self.transport.post(engine.url, input_ids, params, self.fleet.adapter)  # LoRA name or None
        except httpx.TransportError as e:
            self._lost(engine, e)
            raise
        finally:
            engine.in_flight -= 1
            self.gate.leave()
        engine.served += 1
        return out, version

    async def _route(self, ctx: Any) -> "Engine":
        """The engine for ``ctx``'s next request (sticky, else the router's pick), once the gate is
        open; recorded as its pinned / group engine. The caller enters the gate before it awaits
        anything: no await between the last gate check and that, so a pause never misses it."""
        while True:
            await self.gate.wait_open()
            engine = self._sticky(ctx) or await self.router.pick()
            if not self.gate.paused:
                break
        if hasattr(ctx, "pinned_engine"):
            ctx.pinned_engine = engine
        cell = getattr(ctx, "group_engine", None)
        if cell is not None:
            cell[0] = engine
        return engine

    def _lost(self, engine: "Engine", e: BaseException) -> None:
        """An engine's connection failed during /generate: out of routing until the fleet sees it up."""
        if engine.index >= 0:
            self.fleet.mark_down(engine, f"{type(e).__name__} during /generate")

    def _sticky(self, ctx: Any) -> "Engine | None":
        """The engine this context's calls stay on, if any (see ``_once``)."""
        pinned = getattr(ctx, "pinned_engine", None)
        if pinned is not None:
            return pinned if pinned in self.fleet.routable() else None
        cell = getattr(ctx, "group_engine", None)
        if cell is None or cell[0] is None:
            return None
        engine, ready = cell[0], self.fleet.routable()
        if engine in ready and engine.in_flight < min(e.in_flight for e in ready) + self.transport.max_batch:
            return engine
        return None

    async def generate_group(self, ctxs: list["RolloutContext"], input_ids: list[int],
                             sampling: dict[str, Any]) -> list[dict[str, Any] | BaseException]:
        """The answers for ``len(ctxs)`` samples of one prompt (a group of the default generator),
        each as ``generate`` gives it, or the exception it raises. Their first requests go to one
        engine together (one routing decision, one queueing; the transport's futures, no task per
        sample); a sample whose first answer is not final (an error to retry, an abort for a pause
        with tokens to resume) continues alone in ``generate``. When the engine's URL is not
        coalesced, each sample takes ``generate`` from the start."""
        one_sequence(sampling)
        engine = await self._route(ctxs[0])   # the group's cell: every sample's
        if not self.transport.coalesces(engine.url):
            return _unless_stopped(await asyncio.gather(*(self.generate(c, input_ids, sampling) for c in ctxs),
                                                        return_exceptions=True))
        version, epoch, k = self.gate.version, self.gate.abort_epoch, len(ctxs)
        params = dict(sampling, max_new_tokens=int(sampling.get("max_new_tokens", 128)))
        engine.in_flight += k
        self.gate.enter(k)
        try:
            outs = await self.transport.submit_group(engine.url, input_ids, params, k, self.fleet.adapter, compact=True)
        finally:
            engine.in_flight -= k
            self.gate.leave(k)
        lost = next((o for o in outs if isinstance(o, httpx.TransportError)), None)
        if lost is not None:
            self._lost(engine, lost)
        engine.served += sum(not isinstance(o, BaseException) for o in outs)
        answers: list[dict[str, Any] | BaseException] = []
        later: list[int] = []
        for i, (c, o) in enumerate(zip(ctxs, outs)):
            if isinstance(o, BaseException) or (o["meta_info"]["finish_reason"]["type"] == "abort" and
                                                (self.gate.paused or self.gate.abort_epoch != epoch)):
                later.append(i)   # retried or resumed: it may wait, so concurrently with the others
                answers.append(o)
                continue
            if isinstance(o, Answer):   # a final answer: what ``generate`` would make of it
                if o["output_ids"]:
                    c.note_version(version)
                self.tokens_out += len(o["output_ids"])
                answers.append(_completed(o, input_ids, o["meta_info"]["finish_reason"]["type"]))
                continue
            try:   # ``generate`` returns it without awaiting anything (no task needed)
                answers.append(await self.generate(c, input_ids, sampling, (o, version, epoch)))
            except Exception as e:  # noqa: BLE001 - that sample's fault, as gather would return it
                answers.append(e)
        if later:
            redone = await asyncio.gather(*(self.generate(ctxs[i], input_ids, sampling, (answers[i], version, epoch))
                                            for i in later), return_exceptions=True)
            for i, a in zip(later, redone):
                answers[i] = a
        return _unless_stopped(answers)

    async def generate(self, ctx: "RolloutContext", input_ids: list[int], sampling: dict[str, Any],
                       first: tuple[Any, int, int] | None = None) -> dict[str, Any]:
        """One sample's answer (the module docstring's guarantees). ``first``: its first attempt,
        already made by ``generate_group``: (answer or exception, version, abort epoch)."""
        budget = int(sampling.get("max_new_tokens", 128))
        ids: list[int] = []
        lps: list[Any] = []   # SGLang's [logprob, token id, text] entries, as the engines answered
        floats: list[float] = []  # their logprobs
        text = ""
        segments = answers = 0
        attempts = bad = 0
        while True:
            params = dict(sampling, max_new_tokens=budget - len(ids))
            epoch = self.gate.abort_epoch
            try:
                if first is None:
                    out, version = await self._once(list(input_ids) + ids, params, ctx)
                else:
                    (out, version, epoch), first = first, None
                    if isinstance(out, BaseException):
                        raise out
            except (httpx.TransportError, httpx.TimeoutException, Retryable) as e:
                attempts += 1
                bad += isinstance(e, Retryable)
                if attempts >= MAX_ATTEMPTS or bad >= MAX_BAD_ANSWERS:
                    raise EngineError(f"/generate failed {attempts} times; last: {type(e).__name__}: {e}") from None
                ctx.logger.info("rerouting a request after %s: %s", type(e).__name__, e)
                if getattr(ctx, "group_engine", None) is not None:
                    ctx.group_engine[0] = None   # the router picks again, not the group's engine
                await asyncio.sleep(min(2.0, 0.05 * attempts))
                continue
            seg_ids = out["output_ids"]
            if seg_ids:  # a segment counts only when it produced tokens (an abort can come before any)
                ctx.note_version(version)
                segments += 1
            if answers:   # a resumed partial rollout: join the segments
                if lps is None:   # the first segment's answer was compact: its entries, now
                    lps = make_entries(floats, ids)
                ids += seg_ids
                lps += entries_of(out)
                floats += logprobs_of(out)
            else:   # the answer's own lists (parsed for this call alone): no copy of 3 x 2k items
                ids, lps, floats = seg_ids, out["meta_info"].get("output_token_logprobs"), logprobs_of(out)
            text = out.get("text") or ""
            answers += 1
            reason = out["meta_info"]["finish_reason"]["type"]
            ours = self.gate.paused or self.gate.abort_epoch != epoch
            if reason == "abort" and ours and len(ids) < budget:
                if ids:  # partial rollout: held until resume, then continued with the remaining budget
                    self.partial_held += 1
                    try:
                        await self.gate.wait_open()
                    finally:
                        self.partial_held -= 1
                continue
            if reason == "abort" and ours:
                reason = "length"
            break
        self.tokens_out += len(ids)
        if answers == 1 and isinstance(out, Answer) and ids is out["output_ids"] and floats is out.logprobs:
            return _completed(out, input_ids, reason)   # (its checked arrays go with it)
        segments = max(segments, 1)
        if answers > 1 and ctx.tokenizer is not None:
            text = ctx.tokenizer.decode(ids)
        meta = dict(out["meta_info"])
        meta.update(finish_reason=dict(meta["finish_reason"], type=reason),
                    prompt_tokens=len(input_ids), completion_tokens=len(ids), segments=segments)
        if lps is not None:   # (None: one compact answer, whose entries nothing on its path reads)
            meta["output_token_logprobs"] = lps
        return Answer.of({"text": text, "output_ids": ids, "meta_info": meta}, lps, floats)


def _completed(out: Answer, input_ids: list[int], reason: str) -> Answer:
    """A single engine answer made the caller's, in place (nothing else holds it): ``generate``'s
    fields added (``finish_reason`` type ``reason``, prompt and completion tokens, one segment)."""
    meta = out["meta_info"]
    if meta["finish_reason"]["type"] != reason:
        meta["finish_reason"] = dict(meta["finish_reason"], type=reason)
    meta["prompt_tokens"], meta["completion_tokens"], meta["segments"] = len(input_ids), len(out["output_ids"]), 1
    out["text"] = out.get("text") or ""
    return out


def _unless_stopped(answers: list[Any]) -> list[Any]:
    """``answers``, unless one is a cancellation (the service is stopping): raised, as a caller of
    ``generate`` would see it."""
    stop = next((a for a in answers if isinstance(a, BaseException) and not isinstance(a, Exception)), None)
    if stop is not None:
        raise stop
    return list(answers)


class RolloutContext:
    """What a generator / reward / filter sees: routed ``generate``, tokenizer, config, logger.

    One context per sample (its ``weight_version`` tracks that sample's engine calls); ``http`` is a
    shared httpx client for plugins that call other services (e.g. a reward model).
    """

    def __init__(self, client: EngineClient | None, tokenizer: Any, config: RolloutConfig,
                 logger: logging.Logger, http: httpx.AsyncClient | None = None) -> None:
        self._client = client
        self.tokenizer = tokenizer
        self.config = config
        self.logger = logger
        self.http = http
        self.weight_version: int | None = None
        # the engine a group's samples share (a one-item list the loop gives all of them): their
        # batches then hold whole groups (one prompt prefilled and cached once) and a group is
        # done when one engine is, not when the slowest of several is
        self.group_engine: list[Any] | None = None

    def note_version(self, version: int) -> None:
        self.weight_version = version if self.weight_version is None else min(self.weight_version, version)

    async def generate(self, input_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /generate answer for one sequence, routed to a healthy engine."""
        if self._client is None:
            raise RuntimeError("this context has no engine (reward / filter contexts cannot generate)")
        if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
            raise TypeError("ctx.generate: input_ids must be a list of ints")
        return await self._client.generate(self, input_ids, sampling)


# ---- helpers for generators --------------------------------------------------------------------

STATUS = {"length": SampleStatus.truncated.value, "stop": SampleStatus.completed.value,
          "abort": SampleStatus.aborted.value}


def turn_fields(sample: Sample, answer: dict[str, Any], metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields ``append_turn`` gives ``sample`` for ``answer``, as new values (nothing of
    ``sample`` is changed): a model copy with these as its update is the appended sample.
    ``metadata``: what stands for the sample's metadata (a copy it will own), when not its own."""
    ids = answer["output_ids"]
    fields = {"tokens": sample.tokens + ids, "loss_mask": sample.loss_mask + [1] * len(ids),
              "rollout_logprobs": (sample.rollout_logprobs or []) + logprobs_of(answer),
              "response_length": sample.response_length + len(ids),
              "response": (sample.response or "") + (answer.get("text") or ""),
              "status": STATUS[answer["meta_info"]["finish_reason"]["type"]]}
    segments = answer["meta_info"].get("segments", 1)
    if segments > 1:  # a partial rollout resumed after a pause
        meta = sample.metadata if metadata is None else metadata
        fields["metadata"] = {**meta, "resumed": meta.get("resumed", 0) + segments - 1}
    return fields


def append_turn(sample: Sample, answer: dict[str, Any]) -> Sample:
    """Append a /generate answer as model tokens (loss_mask 1) and set status from finish_reason."""
    for name, value in turn_fields(sample, answer).items():
        setattr(sample, name, value)
    return sample


def append_tokens(sample: Sample, ids: list[int], text: str = "") -> Sample:
    """Append tool / environment tokens: part of the response but not trained on (loss_mask 0)."""
    sample.tokens = sample.tokens + list(ids)
    sample.loss_mask = sample.loss_mask + [0] * len(ids)
    sample.rollout_logprobs = (sample.rollout_logprobs or []) + [0.0] * len(ids)
    sample.response_length += len(ids)
    sample.response = (sample.response or "") + text
    return sample


async def single_turn(ctx: RolloutContext, sample: Sample, sampling: dict[str, Any]) -> Sample:
    """The default generator: one /generate call on the prompt tokens."""
    return append_turn(sample, await ctx.generate(sample.tokens, sampling))


def typename(x: Any) -> str:
    """``x``'s type in words for an error message (a list names the types of its items)."""
    if isinstance(x, list):
        return "list of " + ", ".join(sorted({type(v).__name__ for v in x}) or {"nothing"})
    return type(x).__name__


def check_generator(fn: Any, spec: str) -> None:
    """A generator plugin must be an ``async def`` (the contract in the module docstring)."""
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.generate {spec!r}: must be an async function "
                         "(async def generate(ctx, sample, sampling) -> Sample | list[Sample])")
