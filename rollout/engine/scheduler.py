"""Continuous-batching scheduler of the reference engine: one thread owns the model and the KV cache.

Guarantees:
- Only the scheduler thread touches the model and the cache. Everything else (new requests,
  abort, pause, weight loads, memory release) is a command queued with ``call`` and run by that
  thread between two model steps, so no decode step ever runs while weights are being replaced.
- Continuous batching: each loop iteration admits waiting sequences (one batched, right-padded
  prefill) into the running batch, then runs one decode step for every running sequence. A
  request that arrives while others are decoding joins at the next step.
- Finishing follows SGLang's order: length (max_new_tokens) first, then EOS / stop_token_ids
  (skipped with ignore_eos), then stop strings. Aborted sequences finish with what they have.
- Pause modes as SGLang: ``abort`` aborts everything and holds new requests until continue;
  ``in_place`` stops stepping and keeps the KV cache; ``retract`` moves running sequences back to
  the front of the queue and frees their cache (they are re-prefilled with prompt + output so
  far on continue, so no token is lost). While paused, requests queue.
- Generation never runs while the weights are released or a weight-update session is open.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from headrace.rollout.engine.lora import LoraBatch
from headrace.rollout.engine.model import DecoderModel, KVCache
from headrace.rollout.engine.sampling import BatchSampler, SamplingParams
from headrace.rollout.engine.text import TextCodec

log = logging.getLogger("headrace.engine")


@dataclass
class Seq:
    """One sequence being generated (one of the ``n`` samples of one prompt)."""

    rid: str
    group: str                      # the request-level rid (abort by it reaches every sample)
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    on_finish: Callable[["Seq"], None]
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0                 # tokens in the KV cache (the last sampled token is not yet)
    finish: dict[str, Any] | None = None
    stop_str: str | None = None
    stop_len: int = 0
    weight_version: str = ""
    created: float = field(default_factory=time.monotonic)
    aborted_waiting: bool = False   # aborted from the waiting queue (SGLang then omits prompt_tokens)
    lora: Any = None                # the LoRA adapter (rollout.engine.lora.LoraAdapter) it runs with, or None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Scheduler:
    """Owns model, cache and queues; ``start()`` runs the loop in a daemon thread."""

    def __init__(self, model: DecoderModel, codec: TextCodec, eos_ids: set[int], *, seed: int = 0,
                 max_running: int = 256, max_prefill_tokens: int = 8192, logprob_mode: str = "temperature",
                 weight_version: str = "default", batch_wait_s: float = 0.02) -> None:
        self.model, self.codec, self.eos_ids = model, codec, eos_ids
        self.batch_wait_s = batch_wait_s
        self.last_arrival = self.waiting_since = 0.0
        self.sampler = BatchSampler(seed, logprob_mode)
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.cache: KVCache | None = KVCache(model.arch, model.dtype)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.paused: str | None = None
        self.updating = False           # a begin/end weight-update session is open
        self.released: set[str] = set()
        self.weight_version = weight_version
        self.steps = self.generated = 0
        self.prefilled = self.prefill_shared = 0   # rows run through prefill / given a copy of one
        self.last_step = time.monotonic()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], cf.Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ---- API used by other threads ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=3)   # a step in progress finishes; serve's deadline bounds the rest

    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the scheduler thread between two steps; the future holds its result."""
        fut: cf.Future = cf.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    # ---- commands (run on the scheduler thread) ---------------------------------------------

    def add(self, seqs: list[Seq]) -> None:
        now = time.monotonic()
        if not self.waiting:
            self.waiting_since = now
        self.last_arrival = now
        for s in seqs:
            if s.params.max_new_tokens == 0:
                self._finish(s, {"type": "length", "length": 0})
            else:
                self.waiting.append(s)

    def abort(self, rid: str | None = None, message: str = "Abort requested") -> int:
        """Abort sequences whose rid or group is ``rid`` (every one if None); returns the count."""
        n = 0
        for s in list(self.waiting):
            if rid is None or rid in (s.rid, s.group):
                self.waiting.remove(s)
                s.aborted_waiting = True
                self._finish(s, {"type": "abort", "message": message})
                n += 1
        for s in self.running:
            if s.finish is None and (rid is None or rid in (s.rid, s.group)):
                self._finish(s, {"type": "abort", "message": message})
                n += 1
        self._compact()
        return n

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None, "Abort by pause_generation")
        elif mode == "retract":
            self._retract_all()
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def flush_cache(self) -> bool:
        """Free the KV cache memory; refused (False) while sequences hold cache rows. The next
        admission allocates what it needs (zeroing a fresh default cache here cost SmolLM2-sized
        weight updates a quarter of the engine's time)."""
        if self.running:
            return False
        if self.cache is not None:
            self.cache = KVCache(self.model.arch, self.model.dtype, rows=0, capacity=0)
        return True

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> int:
        n = self.model.load_weights(named)
        if version is not None:
            self.weight_version = version
        return n

    def release(self, tags: set[str], stash: Callable[[DecoderModel], None]) -> None:
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self._retract_all()
            self.cache = None
            self.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            self._retract_all()
            stash(self.model)
            self.model.release()
            self.released.add("weights")

    def resume_memory(self, tags: set[str], unstash: Callable[[DecoderModel], None]) -> None:
        if "weights" in tags and "weights" in self.released:
            self.model.reallocate()
            unstash(self.model)
            self.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.cache = KVCache(self.model.arch, self.model.dtype, rows=0, capacity=0)  # grows on admission
            self.released.discard("kv_cache")

    def state(self) -> dict[str, Any]:
        return {"running": len(self.running), "waiting": len(self.waiting), "paused": self.paused,
                "weight_update_session": self.updating, "released": sorted(self.released),
                "steps": self.steps, "generated_tokens": self.generated,
                "prefilled_rows": self.prefilled, "prefill_shared_rows": self.prefill_shared,
                "kv_cache_bytes": self.cache.nbytes() if self.cache is not None else 0,
                "weights_bytes": self.model.nbytes()}

    # ---- the loop ---------------------------------------------------------------------------

    def _can_step(self) -> bool:
        return (self.paused is None and not self.updating and not self.released
                and bool(self.waiting or self.running))

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            if not self._can_step() and self._commands.empty():
                self._wake.wait(timeout=1.0)
            self._wake.clear()
            while not self._commands.empty():
                fn, fut = self._commands.get()
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            if self._stop or not self._can_step():
                continue
            hold = self._burst_hold()
            if hold > 0:
                self._wake.wait(hold)
                continue
            try:
                self._admit()
                if self.running:
                    self._decode()
            except Exception as e:  # a model error must not kill the server
                log.exception("engine step failed")
                for s in list(self.running) + list(self.waiting):
                    self._finish(s, {"type": "abort", "message": f"engine error: {e}"})
                self.running, self.waiting = [], deque()

    def _burst_hold(self) -> float:
        """Seconds to wait for more arrivals before a prefill from idle (0: go now).

        Requests of one burst (e.g. 64 concurrent HTTP calls) arrive over some milliseconds;
        prefilling them as they trickle in would start them at different steps and leave a long
        tail of small decode batches. From idle, admission waits until arrivals pause for
        ``batch_wait_s`` (at most ``10 x batch_wait_s``); with sequences running it never waits.
        """
        if self.running or not self.waiting or self.batch_wait_s <= 0:
            return 0.0
        now = time.monotonic()
        return max(0.0, min(self.last_arrival + self.batch_wait_s, self.waiting_since + 10 * self.batch_wait_s) - now)

    def _admit(self) -> None:
        free = self.max_running - len(self.running)
        if free <= 0 or not self.waiting:
            return
        batch: list[Seq] = []
        longest = 0
        while self.waiting and len(batch) < free:
            n = len(self.waiting[0].tokens)
            if batch and max(longest, n) * (len(batch) + 1) > self.max_prefill_tokens:
                break
            batch.append(self.waiting.popleft())
            longest = max(longest, n)
        assert self.cache is not None
        row0 = len(self.running)
        self.cache.ensure(row0 + len(batch), longest + 1)
        # identical token lists (the n samples of one prompt: a GRPO group) are prefilled once, as
        # SGLang's prefix cache would: the first of each runs the model into row row0 + j (j: its
        # rank among the distinct lists), then every row of the batch copies its list's row and logits
        first: dict[tuple[Any, ...], int] = {}
        source = [first.setdefault((id(s.lora), *s.tokens), len(first)) for s in batch]
        run = []   # the first sequence of each distinct list, in order (source ids count up from 0)
        for s, j in zip(batch, source):
            if j == len(run):
                run.append(s)
        ids = torch.zeros(len(run), longest, dtype=torch.long)
        for r, s in enumerate(run):
            t = s.tokens
            ids[r, :len(t)] = torch.tensor(t)
        last = torch.tensor([len(s.tokens) - 1 for s in run])
        logits = self.model.forward(ids, self.cache, row0, last=last, lora=LoraBatch.of(run))
        self.prefilled += len(run)
        if len(run) < len(batch):
            self.prefill_shared += len(batch) - len(run)
            src = torch.tensor(source)
            rows = src + row0   # gathered (a copy) before the assignment, so overlapping rows are safe
            self.cache.k[:, row0:row0 + len(batch), :, :longest] = self.cache.k[:, rows, :, :longest]
            self.cache.v[:, row0:row0 + len(batch), :, :longest] = self.cache.v[:, rows, :, :longest]
            logits = logits[src]
        for s in batch:
            s.cached = len(s.tokens)
        self.running.extend(batch)
        self._append(batch, logits)

    def _decode(self) -> None:
        assert self.cache is not None
        seqs = self.running
        lens = torch.tensor([s.cached for s in seqs])
        self.cache.ensure(len(seqs), int(lens.max()) + 1)
        ids = torch.tensor([s.output[-1] for s in seqs]).view(-1, 1)
        logits = self.model.forward(ids, self.cache, 0, lens=lens, lora=LoraBatch.of(seqs))
        for s in seqs:
            s.cached += 1
        self._append(seqs, logits)

    def _append(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        ids, lps = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for s, t, lp in zip(seqs, ids.tolist(), lps.tolist()):
            s.output.append(t)
            s.logprobs.append(lp)
            reason = self._check(s, t)
            if reason is not None:
                self._finish(s, reason)
        self.steps += 1
        self.generated += len(seqs)
        self.last_step = time.monotonic()
        self._compact()

    def _check(self, s: Seq, t: int) -> dict[str, Any] | None:
        p = s.params
        if len(s.output) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if not p.ignore_eos and (t in self.eos_ids or t in p.stop_token_ids):
            return {"type": "stop", "matched": t}
        if p.stop:
            if not s.stop_len:
                s.stop_len = self.codec.stop_token_len(p.stop)
            m = self.codec.matched_stop(s.output, p.stop, s.stop_len)
            if m is not None:
                s.stop_str = m
                return {"type": "stop", "matched": m}
        return None

    def _finish(self, s: Seq, reason: dict[str, Any]) -> None:
        if s.finish is not None:
            return
        s.finish = reason
        s.weight_version = self.weight_version
        try:
            s.on_finish(s)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
            log.exception("finish callback failed for %s", s.rid)

    def _compact(self) -> None:
        """Drop finished rows, moving the last running row into each hole (cache rows follow)."""
        run, i = self.running, 0
        while i < len(run):
            if run[i].finish is None:
                i += 1
                continue
            last = len(run) - 1
            if i != last and self.cache is not None:
                self.cache.move(last, i)
            run[i] = run[last]
            run.pop()

    def _retract_all(self) -> None:
        for s in reversed(self.running):
            if s.finish is None:
                s.cached = 0
                self.waiting.appendleft(s)
        self.running = []
