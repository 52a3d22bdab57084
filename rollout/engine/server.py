"""HTTP front of the reference engine: SGLang 0.5.23's native API subset with SGLang's JSON shapes.

Python API: ``build_app(model_dir, ...)`` returns the FastAPI app (its ``state.engine`` is the
``Engine``); ``serve(model_dir, host, port, ...)`` runs it with uvicorn (blocking).

Guarantees:
- ``/generate`` answers like SGLang: one object ``{"text", "output_ids", "meta_info"}`` for a
  single prompt with n = 1, a list otherwise (batch x n, grouped by prompt). ``meta_info`` has
  ``id``, ``finish_reason`` (``{"type": "length"|"stop"|"abort", ...}``), ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``weight_version``, ``e2e_latency`` and, with
  ``return_logprob``, ``output_token_logprobs`` = ``[[logprob, token_id, text|null], ...]``.
  A sequence aborted while still waiting (never prefilled, or retracted) has no
  ``prompt_tokens``/``cached_tokens``, as SGLang answers an abort from its waiting queue.
- A client that disconnects before its answer aborts its request (as SGLang does).
- ``/health`` and ``/health_generate`` answer 503 while generation is paused (SGLang's run a
  generation, which a pause holds).
- Bad input is a 400 ``{"error": {"message": ...}}`` naming the problem; the server keeps serving.
- Bounded work (DESIGN.md "Trust"): a body over ``max_body_mb`` is a 413 before it is parsed; a
  ``/generate`` asking for more than ``max_batch`` sequences (prompts x n), or an ``n`` outside
  [1, 1024], is a 422 naming the limit; beyond ``max_queued`` unanswered ``/generate`` requests
  the next is a 429 with ``Retry-After``. ``serve`` stops within ``shared.serving.DEADLINE_S`` of
  SIGTERM whatever runs (a long generation, a weight-sync rendezvous that never answers), and
  with ``parent_pid`` the engine stops once that process is gone.
  Generation while the weights are released, or after a failed weight update left them partly
  written, is a 503 with the reason.
- Weight updates: see ``rollout.engine.updates`` (disk loads, memory) and ``rollout.engine.session``
  (the update session's rules). LoRA adapters (``/load_lora_adapter``, ``/unload_lora_adapter``,
  ``lora_path`` in ``/generate``): see ``rollout.engine.lora_routes``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from headrace.rollout.engine.confine import WeightDirs
from headrace.rollout.engine.http import json_body, json_response
from headrace.rollout.engine.lora_routes import LoraRegistry, add_lora_routes
from headrace.rollout.engine.model import DecoderModel, resolve_dtype
from headrace.rollout.engine.sampling import LimitError, parse_sampling_params
from headrace.rollout.engine.scheduler import Scheduler, Seq
from headrace.rollout.engine.text import TextCodec, eos_token_ids, load_tokenizer_or_none
from headrace.rollout.engine.updates import WeightUpdates
from headrace.shared.auth import protect

log = logging.getLogger("headrace.engine")
VERSION = "0.5.23-headrace-reference"
PAUSE_MODES = ("abort", "retract", "in_place")


class BadRequest(ValueError):
    """A client error; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


def error(message: str, status: int = 400, headers: dict[str, str] | None = None) -> Response:
    r = json_response({"error": {"message": message}}, status)
    r.headers.update(headers or {})
    return r


class Engine:
    """Model + scheduler + server state shared by the HTTP handlers."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", seed: int = 0, max_running_requests: int = 256,
                 max_prefill_tokens: int = 8192, logprob_mode: str = "temperature",
                 weight_version: str = "default", weight_sync_timeout_s: float = 600.0, batch_wait_ms: float = 20.0,
                 host: str = "127.0.0.1", port: int = 30000, allowed_weight_dirs: tuple[str, ...] = (),
                 max_batch: int = 4096, max_queued: int = 4096) -> None:
        self.model_path = str(model_dir)
        self.max_batch, self.max_queued = max_batch, max_queued
        self.queued = 0                 # /generate requests admitted and not yet answered
        self.tokenizer = load_tokenizer_or_none(model_dir)
        self.codec = TextCodec(self.tokenizer)
        self.model = DecoderModel.from_pretrained(model_dir, resolve_dtype(dtype))
        arch = self.model.arch
        self.context_length = arch.max_position_embeddings
        self.args = {"model_path": self.model_path, "tokenizer_path": self.model_path if self.tokenizer else None,
                     "host": host, "port": port, "dtype": str(self.model.dtype).removeprefix("torch."),
                     "random_seed": seed, "max_running_requests": max_running_requests,
                     "max_prefill_tokens": max_prefill_tokens, "batch_wait_ms": batch_wait_ms, "context_length": self.context_length,
                     "logprob_mode": logprob_mode, "skip_tokenizer_init": self.tokenizer is None,
                     "device": "cpu", "tp_size": 1, "torch_threads": torch.get_num_threads(),
                     "max_batch": max_batch, "max_queued": max_queued}
        self.seed = seed
        self.scheduler = Scheduler(self.model, self.codec, eos_token_ids(model_dir, arch.eos_token_id, self.tokenizer),
                                   seed=seed, max_running=max_running_requests,
                                   max_prefill_tokens=max_prefill_tokens, logprob_mode=logprob_mode,
                                   weight_version=weight_version, batch_wait_s=batch_wait_ms / 1000.0)
        self.updates = WeightUpdates(self, weight_sync_timeout_s, WeightDirs(model_dir, allowed_weight_dirs))
        self.loras = LoraRegistry(self)   # LoRA adapters (rollout.engine.lora_routes), confined like disk loads

    async def run(self, fn: Any) -> Any:
        """Run ``fn`` on the scheduler thread and await its result."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ---- /generate --------------------------------------------------------------------------

    def parse(self, body: Any) -> tuple[bool, list[tuple[list[int], Any, bool, str, Any]], bool]:
        """(is_batch, [(prompt ids, sampling params, return_logprob, rid, LoRA adapter)], text_in_logprobs)."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the reference engine")
        if body.get("top_logprobs_num") or body.get("token_ids_logprob"):
            raise BadRequest("top_logprobs_num / token_ids_logprob are not supported by the reference engine")
        text, ids = body.get("text"), body.get("input_ids")
        if text is None and ids is None:
            raise BadRequest("either text or input_ids is required")
        if text is not None and ids is not None:
            raise BadRequest("give either text or input_ids, not both")
        if text is not None:
            batch = isinstance(text, list)
            texts = text if batch else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a non-empty list of strings")
            try:
                prompts = [self.codec.encode(t) for t in texts]
            except ValueError as e:
                raise BadRequest(str(e)) from None
        else:
            batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            prompts = ids if batch else [ids]
            for i, p in enumerate(prompts):
                if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise BadRequest(f"input_ids[{i}] must be a list of integers" if batch else
                                     "input_ids must be a list of integers or a list of lists of integers")
        n_items = len(prompts)
        if n_items > self.max_batch:
            raise BadRequest(f"{n_items} prompts in one /generate: this engine takes at most --max-batch "
                             f"{self.max_batch} sequences per request", 422)
        sps = self._per_item(body.get("sampling_params"), n_items, "sampling_params", dict)
        lps = self._per_item(body.get("return_logprob"), n_items, "return_logprob", bool)
        rid = body.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n_items)]
        elif isinstance(rid, str):
            rids = [rid] if not batch else [f"{rid}_{i}" for i in range(n_items)]
        elif isinstance(rid, list) and len(rid) == n_items and all(isinstance(r, str) for r in rid):
            rids = rid
        else:
            raise BadRequest("rid must be a string or a list of strings, one per prompt")
        try:
            loras = self.loras.resolve(body.get("lora_path"), n_items, batch)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        vocab = self.model.arch.vocab_size
        items = []
        for i, (p, sp, lp, r, lora) in enumerate(zip(prompts, sps, lps, rids, loras)):
            field = "text" if text is not None else "input_ids"
            where = f"{field}[{i}]" if batch else field
            if not p:
                raise BadRequest(f"{where} is empty: the prompt needs at least one token")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"{where} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            try:
                params = parse_sampling_params(sp, vocab)
            except ValueError as e:
                raise BadRequest(str(e), 422 if isinstance(e, LimitError) else 400) from None
            if len(p) >= self.context_length:
                raise BadRequest(f"The input ({len(p)} tokens) is longer than the model's context length "
                                 f"({self.context_length} tokens).")
            if len(p) + params.max_new_tokens > self.context_length:
                raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                                 f"{self.context_length} tokens. You requested a total of "
                                 f"{len(p) + params.max_new_tokens} tokens: {len(p)} tokens from the input "
                                 f"messages and {params.max_new_tokens} tokens for the completion.")
            if params.stop and not self.codec.available:
                raise BadRequest("sampling_params.stop needs a tokenizer; this model directory has none")
            items.append((list(p), params, bool(lp), r, lora))
        total = sum(params.n for _, params, *_ in items)
        if total > self.max_batch:
            raise BadRequest(f"this /generate asks for {total} sequences (prompts x n): this engine takes at most "
                             f"--max-batch {self.max_batch} per request", 422)
        return batch, items, bool(body.get("return_text_in_logprobs", False))

    @staticmethod
    def _per_item(v: Any, n: int, name: str, kind: type) -> list[Any]:
        if isinstance(v, list):
            if len(v) != n:
                raise BadRequest(f"{name} is a list of {len(v)} but there are {n} prompts")
            return v
        if v is not None and not isinstance(v, kind):
            raise BadRequest(f"{name} must be {'an object' if kind is dict else 'a boolean'} or a list of them")
        return [v] * n

    def make_seqs(self, items: list[tuple[list[int], Any, bool, str, Any]], loop: asyncio.AbstractEventLoop
                  ) -> tuple[list[Seq], list[asyncio.Future]]:
        seqs, futs = [], []
        for prompt, params, lp, rid, lora in items:
            for j in range(params.n):
                fut = loop.create_future()
                gen = None
                if params.sampling_seed is not None:
                    gen = torch.Generator().manual_seed(params.sampling_seed + j)
                seqs.append(Seq(rid=rid if params.n == 1 else f"{rid}_{j}", group=rid, prompt=prompt,
                                params=params, return_logprob=lp, generator=gen, lora=lora,
                                on_finish=lambda s, f=fut: loop.call_soon_threadsafe(_resolve, f, s)))
                futs.append(fut)
        return seqs, futs

    def render(self, s: Seq, text_in_logprobs: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": s.rid, "finish_reason": s.finish, "prompt_tokens": len(s.prompt),
            "completion_tokens": len(s.output), "cached_tokens": 0, "weight_version": s.weight_version,
            "e2e_latency": round(time.monotonic() - s.created, 6),
        }
        if s.aborted_waiting:  # as SGLang's tokenizer manager answers an abort from the waiting queue
            del meta["prompt_tokens"], meta["cached_tokens"]
        if s.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, self.codec.token_text(t) if text_in_logprobs else None] for lp, t in zip(s.logprobs, s.output)]
        text = self.codec.output_text(s.output, s.stop_str, not s.params.no_stop_trim)
        return {"text": text, "output_ids": list(s.output), "meta_info": meta}

    def unavailable(self) -> str | None:
        if self.scheduler.released:
            return (f"memory is released ({', '.join(sorted(self.scheduler.released))}): "
                    "call /resume_memory_occupation before generating")
        broken = self.updates.session.broken
        if broken:
            return f"weights are partly updated after a failed update ({broken}); run a full update first"
        return None

    async def generate(self, body: Any) -> Any:
        if self.queued >= self.max_queued:
            raise BadRequest(f"{self.queued} /generate requests are already queued (--max-queued "
                             f"{self.max_queued}); retry later", 429, {"Retry-After": "1"})
        self.queued += 1
        try:
            return await self._generate(body)
        finally:
            self.queued -= 1

    async def _generate(self, body: Any) -> Any:
        batch, items, text_lp = self.parse(body)
        why = self.unavailable()
        if why:
            raise BadRequest(why, 503)
        loop = asyncio.get_running_loop()
        seqs, futs = self.make_seqs(items, loop)
        self.scheduler.call(lambda: self.scheduler.add(seqs))
        try:
            done = await asyncio.gather(*futs)
        except asyncio.CancelledError:
            groups = {s.group for s in seqs}
            self.scheduler.call(lambda: [self.scheduler.abort(g, "client went away") for g in groups])
            raise
        out = [self.render(s, text_lp) for s in done]
        return out if batch or len(out) > 1 else out[0]

    async def health_generate(self, timeout: float = 20.0) -> bool:
        if self.unavailable():
            return False
        sch = self.scheduler
        if sch.paused or sch.updating or sch.running:
            return sch.alive()
        params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}, self.model.arch.vocab_size)
        loop = asyncio.get_running_loop()
        seqs, futs = self.make_seqs([([0], params, False, f"HEALTH_CHECK_{time.time()}", None)], loop)
        sch.call(lambda: sch.add(seqs))
        try:
            await asyncio.wait_for(futs[0], timeout)
        except asyncio.TimeoutError:
            sch.call(lambda: sch.abort(seqs[0].rid, "health check timed out"))
            return False
        return seqs[0].finish is not None and seqs[0].finish.get("type") != "abort"


def _resolve(fut: asyncio.Future, s: Seq) -> None:
    if not fut.done():
        fut.set_result(s)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json(request: Request) -> Any:
    try:
        return await json_body(request)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def build_app(model_dir: str | Path, auth: Any = None, **engine_kwargs: Any) -> FastAPI:
    """The FastAPI app of one reference engine; the model is loaded now, the scheduler starts with the app.
    ``auth`` (an ``AuthConfig``): with a token, every endpoint but /health needs it (``shared.auth``)."""
    engine = Engine(model_dir, **engine_kwargs)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.scheduler.start()
        try:
            yield
        finally:
            engine.scheduler.call(lambda: engine.scheduler.abort(None, "server shutting down"))
            engine.scheduler.stop()

    app = FastAPI(title="headrace reference engine", version=VERSION, lifespan=lifespan)
    app.state.engine = engine
    protect(app, auth)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> Response:  # noqa: ANN202
        return error(str(exc), exc.status, exc.headers)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        task = asyncio.ensure_future(engine.generate(await _json(request)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():                       # like SGLang: a client that goes away aborts its request
            task.cancel()
            return Response(status_code=499)
        gone.cancel()
        return json_response(task.result())

    # SGLang's /health and /health_generate run a one-token generation: while generation is
    # paused that cannot happen and they answer 503 (SGLang after its health-check timeout, here at once)
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.scheduler.alive() and not engine.scheduler.paused else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.scheduler.paused:
            return Response(status_code=503)
        return Response(status_code=200 if await engine.health_generate() else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": engine.model_path, "tokenizer_path": engine.args["tokenizer_path"],
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.scheduler.weight_version}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.scheduler.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await _json(request)
        new = body.get("new_version")
        if not isinstance(new, str) or not new:
            raise BadRequest("new_version must be a non-empty string")
        if body.get("abort_all_requests"):
            await engine.run(lambda: engine.scheduler.abort(None, "Abort by update_weight_version"))
        engine.scheduler.weight_version = new
        return {"success": True, "message": f"Weight version updated to {new}", "new_version": new}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        state = await engine.run(engine.scheduler.state)
        return {**engine.args, "model_path": engine.model_path, "weight_version": engine.scheduler.weight_version,
                "max_total_num_tokens": engine.context_length * engine.args["max_running_requests"],
                "internal_states": [state], "queued_requests": engine.queued, "version": VERSION}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        st = await engine.run(engine.scheduler.state)
        return [{"dp_rank": 0, "num_reqs": st["running"] + st["waiting"], "num_waiting_reqs": st["waiting"]}]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await engine.run(engine.scheduler.flush_cache)
        return Response(content="Cache flushed.\nPlease check backend logs for more details. (When there are "
                        "running or waiting requests, the operation will not be performed.)\n",
                        status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json(request)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        if abort_all:
            await engine.run(lambda: engine.scheduler.abort(None, "Abort by abort_request(abort_all)"))
        elif rid:
            await engine.run(lambda: engine.scheduler.abort(rid, "Abort by abort_request"))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Any:
        mode = (await _json(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        await engine.run(lambda: engine.scheduler.pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> Any:
        await engine.run(engine.scheduler.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    engine.updates.register(app)
    add_lora_routes(app, engine.loras)
    return app


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 30000, threads: int | None = None,
          log_level: str = "warning", switch_interval_s: float = 0.0005, max_body_mb: float = 64.0,
          parent_pid: int | None = None, **engine_kwargs: Any) -> None:
    """Load the model and serve the engine until SIGTERM / SIGINT (or ``parent_pid`` is gone); blocking."""
    from headrace.shared.serving import BodyLimit, watch_parent
    from headrace.shared.serving import serve as run

    if threads:
        torch.set_num_threads(threads)
    # The scheduler thread runs many short torch ops, each re-taking the GIL; with the default 5 ms
    # switch interval a busy event loop (a burst of requests) makes every op wait up to 5 ms.
    sys.setswitchinterval(switch_interval_s)
    if parent_pid is not None:
        watch_parent(parent_pid)
    app = build_app(model_dir, host=host, port=port, **engine_kwargs)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("reference engine for %s on http://%s:%d (torch threads %d)", model_dir, host, port,
             torch.get_num_threads())
    limited = BodyLimit(app, int(max_body_mb * 1024 * 1024), "--max-body-mb", lambda m: {"error": {"message": m}})
    run(limited, host, port, log_level=log_level, name="headrace engine")
