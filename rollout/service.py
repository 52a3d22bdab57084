"""The rollout service's HTTP app (DESIGN.md "Rollout service", control API).

Endpoints: GET /health, GET /v1/status, GET /v1/engines, POST /v1/pause, POST /v1/resume,
POST /v1/generate_batch, POST /v1/release_memory, POST /v1/resume_memory, POST /v1/evaluate,
POST /v1/load_adapter (``trainer.lora_sync: adapter``, ``rollout.adapters``); the agent
gateway's episodes and OpenAI API (``rollout/gateway/``, DESIGN.md "Agent gateway").

Guarantees:
- Plugins (generate / reward / filter) are loaded from the config at start-up; a bad path or a
  non-async generator stops start-up with one message naming the key. Nothing in a request can
  name code to load.
- ``/v1/pause`` returns only when no engine request is in flight. ``abort`` pauses the engines
  (``/pause_generation {"mode":"abort"}``, repeated ``/abort_request {"abort_all":true}`` until
  idle; every third round, continue and pause again, so that a request that reached an engine
  after its pause, held where abort does not reach as in SGLang, is let in and aborted); the
  aborted samples keep their tokens and continue after ``/v1/resume`` with the rest of their
  budget; the answer's ``partial`` says how many requests hold partial tokens (also in
  ``/v1/status``). ``drain`` lets running requests finish and admits no new ones.
- ``/v1/resume {"weight_version": v}`` marks v as the engines' weights (engines restarted meanwhile
  rejoin routing), continues the engines and tags every later token with v.
- ``/v1/generate_batch`` tags its samples with ``weight_version`` from the request, or else with the
  version all engines report on ``/get_weight_version`` (set by the trainer's weight update).
- Bounded, strict input: bodies are JSON objects of known fields, integers are JSON integers (not
  "7", true or 3.0; a weight version is an int in [0, 2^63)), anything else is a 422 naming the
  field; ``groups`` is at most the admission cap ((buffer.max_staleness + 1) x
  rollout.groups_per_step: more could never be admitted at once, and the trainer asks for
  groups_per_step); a body over ``rollout.max_body_mb`` is a 413 (``shared.serving.BodyLimit``).
- ``/v1/generate_batch`` is a plain Starlette route in the same app (same middleware: token, body
  bound), its body validated by the same model and its errors answered by FastAPI's handlers (a
  422 lists ``{"loc": ["body", field], "msg", "type"}`` as for the other endpoints). FastAPI's
  per-request machinery took ~0.15 ms of the ~0.65 ms from the request's arrival to the round's
  start, and ~0.06 ms of the answer's way out, once a round (bench/rollout_bench.py, traced).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Literal

import httpx
import orjson
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import Response

from headrace.rollout.adapters import AdapterError, AdapterSync
from headrace.rollout.data import DataSource
from headrace.rollout.filters import load_filter
from headrace.rollout.fleet import Engine, Fleet
from headrace.shared.procs import free_port
from headrace.rollout.generate import EngineClient, Gate, check_generator, single_turn
from headrace.rollout.gateway import routes as gateway_routes
from headrace.rollout.gateway.agents import load_agent
from headrace.rollout.gateway.gateway import Gateway
from headrace.rollout.loop import RolloutLoop
from headrace.rollout.rewards import load_reward
from headrace.rollout.router import LeastInFlight, SGLangRouter
from headrace.shared.client import AsyncBufferClient
from headrace.shared.config import HeadraceConfig
from headrace.shared.plugins import load_plugin
from headrace.shared.weight_sync.adapter import LoadAdapterRequest, adapter_mode, adapter_root

log = logging.getLogger("headrace.rollout")


MAX_VERSION = 2**63 - 1   # versions are stored as SQLite INTEGERs by the buffer
HELD_RELEASE_ROUNDS = 3   # abort rounds (1 s each) before a pause lets held requests in and pauses again


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PauseRequest(_Body):
    mode: Literal["abort", "drain"] = "abort"
    timeout_s: float = Field(default=600.0, gt=0, le=86_400, description="give up (504) after this long")


class ResumeRequest(_Body):
    weight_version: int | None = Field(default=None, ge=0, le=MAX_VERSION, description="version of the engines' weights now")


class BatchRequest(_Body):
    groups: int = Field(ge=1, description="at most the admission cap")
    weight_version: int | None = Field(default=None, ge=0, le=MAX_VERSION)


class MemoryRequest(_Body):
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = Field(default=None, max_length=3)


class EvalRequest(_Body):
    n: int | None = Field(default=None, ge=1, le=10_000_000, description="first n held-out prompts (default all)")
    part: list[int] | None = Field(default=None, min_length=2, max_length=2, description="[i, k]: only prompts "
                                   "i, i + k, ... of those (the trainer's split over k rollout services)")

    @model_validator(mode="after")
    def _part_in_range(self) -> "EvalRequest":
        if self.part is not None and not (1 <= self.part[1] <= 100_000 and 0 <= self.part[0] < self.part[1]):
            raise ValueError(f"part {list(self.part)}: need [i, k] with 1 <= k <= 100000 and 0 <= i < k")
        return self


def load_tokenizer(model_dir: str) -> Any:
    from headrace.shared.modelzoo import load_tokenizer as _load

    return _load(model_dir)


class RolloutService:
    """Wires data, fleet, router, plugins and the loop together; owns start / stop."""

    def __init__(self, cfg: HeadraceConfig, launch_engines: bool = False) -> None:
        rc = cfg.rollout
        self.cfg = cfg
        self.generate_fn = load_plugin(rc.generate, what="rollout.generate") if rc.generate else single_turn
        if rc.generate:
            check_generator(self.generate_fn, rc.generate)
        self.reward_fn = load_reward(rc.reward)
        if rc.agent and rc.generate:
            raise ValueError("rollout.agent and rollout.generate are both set: an agent replaces the generator")
        self.agent_fn = load_agent(rc.agent) if rc.agent else None
        self.app: Any = None   # the ASGI app (create_app): in-service agents' calls are served through it
        self.filter_fn = load_filter(rc.filter)
        self.log_dir = Path(cfg.run.out) / "logs"
        self.fleet = Fleet(rc.engines, cfg.model, self.log_dir, token=cfg.auth.token)
        self.adapters = AdapterSync(self.fleet)   # trainer.lora_sync: adapter (POST /v1/load_adapter)
        if adapter_mode(cfg):
            self.fleet.adapter_root = adapter_root(cfg)
        if launch_engines:   # they load their model while the data and the tokenizer load here
            self.fleet.launch()   # (`start` waits for them; a failure before serving ends them)
        try:
            self.state_path = cfg.resolved_path(rc.state_path, "rollout_state.json")
            self.data = DataSource(rc.data, self.state_path)
            self.run_id = rc.run_id or "r" + hashlib.sha1(str(self.state_path.resolve()).encode()).hexdigest()[:8]
            self.tokenizer = load_tokenizer(cfg.model)
        except BaseException:
            self.fleet.kill_launched()
            raise
        self.gate = Gate()
        self.started = time.time()

    async def start(self) -> None:
        rc = self.cfg.rollout
        await self.fleet.start()
        if rc.router == "sglang":
            self.router: LeastInFlight | SGLangRouter = SGLangRouter(
                self.fleet, rc.engines.python, rc.engines.router_port or free_port(), self.log_dir, rc.router_args)
            self.fleet.on_replaced = self.router.engine_replaced
        else:
            self.router = LeastInFlight(self.fleet)
        try:
            await self.router.start()
        except BaseException:
            await self.fleet.stop()
            raise
        self.engine = EngineClient(self.fleet, self.router, self.gate, rc.engines.request_timeout_s,
                                   rc.engines.coalesce_ms / 1000.0, rc.engines.coalesce_max)
        self.http = httpx.AsyncClient(timeout=rc.reward_timeout_s)
        self.buffer = AsyncBufferClient(self.cfg.buffer.url, token=self.cfg.auth.token, retries=1, timeout=30.0)
        self.loop = RolloutLoop(self.cfg, self.data, self.engine, self.tokenizer, self.generate_fn,
                                self.reward_fn, self.filter_fn, self.buffer, self.run_id, self.http)
        self.gateway = Gateway(self.cfg, self.engine, self.tokenizer, self.reward_fn, self.loop.pusher.push,
                               self.run_id, self.http, self.agent_fn, app=self.app)
        self.loop.agent = self.gateway.agent
        self.gateway.start()
        # A restarted service must tag samples with the version its engines hold (a trainer may have
        # pushed several versions already), or everything it generates is evicted as stale.
        version = await self.engines_version()
        if version:
            self.fleet.set_version(version)
            self.gate.version = version
            await self.adapters.adopt(version)   # engines serving adapter v<version>: generation names it
        if self.fleet.held:   # paused by our predecessor: stay paused until the trainer's /v1/resume
            self.gate.close()
            self.fleet.quiet.add("paused")
        self.loop.start()
        log.info("rollout service up: %d engines, mode %s, run id %s, data at %s", len(self.fleet.engines),
                 rc.mode, self.run_id, self.data.state())

    async def stop(self) -> None:
        if hasattr(self, "loop"):
            await self.gateway.stop()
            await self.loop.stop()
            await self.engine.transport.close()
            await self.buffer.close()
            await self.http.aclose()
        if hasattr(self, "router"):
            await self.router.stop()
        await self.fleet.stop()

    # ---- control ----

    async def pause(self, req: PauseRequest) -> dict[str, Any]:
        t0 = time.monotonic()
        self.gate.close()
        self.fleet.quiet.add("paused")
        if req.mode == "abort":
            self.gate.abort_epoch += 1
            await self.fleet.broadcast("/pause_generation", {"mode": "abort"}, timeout=30.0)
            rounds = 0
            while not await self.gate.wait_idle(1.0):
                if time.monotonic() - t0 > req.timeout_s:
                    raise HTTPException(504, f"{self.gate.in_flight} requests still in flight after {req.timeout_s} s")
                rounds += 1
                if rounds % HELD_RELEASE_ROUNDS == 0:
                    # a request that reached an engine after its pause is held there, and SGLang holds it
                    # where abort_all does not reach (engine contract, ABORT_REACHES_HELD_REQUESTS): let
                    # it in and pause again, which aborts it with what it generated meanwhile
                    log.info("pause: %d requests still in flight after %d aborts: continue and pause again",
                             self.gate.in_flight, rounds)
                    await self.fleet.broadcast("/continue_generation", {}, timeout=30.0)
                    await self.fleet.broadcast("/pause_generation", {"mode": "abort"}, timeout=30.0)
                else:
                    await self.fleet.broadcast("/abort_request", {"abort_all": True}, timeout=10.0)
        elif not await self.gate.wait_idle(req.timeout_s):
            raise HTTPException(504, f"{self.gate.in_flight} requests still in flight after {req.timeout_s} s")
        return {"paused": True, "mode": req.mode, "in_flight": self.gate.in_flight,
                "partial": self.engine.partial_held, "seconds": round(time.monotonic() - t0, 3)}

    async def resume(self, req: ResumeRequest) -> dict[str, Any]:
        v = self.gate.version if req.weight_version is None else req.weight_version
        self.fleet.set_version(v)
        switched = self.adapters.switch(v)   # adapter sync: generation names v<v> from now on
        results = await self.fleet.broadcast("/continue_generation", {}, timeout=30.0)
        self.fleet.quiet.discard("paused")
        self.gate.open(v)
        bad = {u: r for u, r in results.items() if r.get("status") not in (200, 404)}
        out = {"paused": False, "weight_version": v, "engine_errors": bad}
        if switched:
            out["adapter"], out["adapter_unload_errors"] = self.fleet.adapter, await self.adapters.unload_old()
        return out

    async def memory(self, path: str, req: MemoryRequest) -> dict[str, Any]:
        if self.gate.in_flight:
            raise HTTPException(409, f"{self.gate.in_flight} requests in flight: POST /v1/pause first")
        releasing = path.startswith("/release")
        if releasing:
            self.fleet.quiet.add("memory released")
        results = await self.fleet.broadcast(path, {"tags": req.tags}, timeout=300.0)
        if not releasing and all(r.get("status") == 200 for r in results.values()):
            self.fleet.quiet.discard("memory released")
        bad = {u: r for u, r in results.items() if r.get("status") != 200}
        if bad:
            raise HTTPException(502, {"message": f"{path} failed on {len(bad)} engine(s)", "engines": bad})
        return {"ok": True, "engines": len(results)}

    async def engines_version(self) -> int | None:
        """The weight version every routable engine reports (/get_weight_version), if they agree on
        an integer; on_demand batches are tagged with it when the caller does not say. The engines
        are asked at once (one round trip for a fleet of any size)."""

        async def one(e: Engine) -> int | None:
            try:
                r = await self.fleet.wire.request("GET", f"{e.url}/get_weight_version", timeout_s=10.0)
                return int(orjson.loads(r.content)["weight_version"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return None

        seen = set(await asyncio.gather(*(one(e) for e in self.fleet.routable())))
        return seen.pop() if len(seen) == 1 and None not in seen else None

    def status(self) -> dict[str, Any]:
        up = time.time() - self.started
        loop = self.loop
        return {
            "weight_version": self.gate.version, "paused": self.gate.paused, "mode": self.cfg.rollout.mode,
            "run_id": self.run_id, "engines": [e.status() for e in self.fleet.engines],
            "router": getattr(self.router, "url", "builtin"),
            "in_flight": self.gate.in_flight, "partial": self.engine.partial_held,
            "groups_in_flight": loop.groups_in_flight,
            "produced": loop.counts["groups_pushed"], "counts": loop.counts | {"prompts_ahead": loop.prompts.hits},
            "push": vars(loop.pusher.stats) | {"pending": loop.pusher.pending},
            "buffer_backlog": loop.backlog, "admission_cap": loop.admission_cap,
            "admission_share": loop.admission_share,
            "generate_requests": self.engine.transport.requests, "sequences_sent": self.engine.transport.sequences,
            "refused_batches": self.engine.transport.refused_batches,
            "compact_answers": self.engine.transport.compact_answers,
            "tokens": self.engine.tokens_out, "tokens_per_s": round(self.engine.tokens_out / max(up, 1e-9), 2),
            "uptime_s": round(up, 1), "data": self.data.state(), "adapter": self.fleet.adapter,
            "gateway": self.gateway.status(), "prefix_breaks": self.gateway.store.counts["prefix_breaks"],
        }


def create_app(cfg: HeadraceConfig, launch_engines: bool = False) -> FastAPI:
    """The FastAPI app; plugins and data load here (errors surface before serving). With
    ``launch_engines`` (``headrace rollout serve``) the engines this service launches are started
    here, before the data and tokenizer load, rather than when the app starts."""
    svc = RolloutService(cfg, launch_engines)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="headrace rollout", lifespan=lifespan)
    app.state.service = svc
    svc.app = app
    # 401 without the run token on every endpoint but /health (and /openai/, where episode keys are checked)
    gateway_routes.protect(app, cfg.auth)
    gateway_routes.mount(app, lambda: svc.gateway)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": svc.gate.version, "paused": svc.gate.paused,
                "engines_healthy": len(svc.fleet.routable())}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return svc.status()

    @app.get("/v1/engines")
    async def engines() -> list[dict[str, Any]]:
        return [{"url": e.url, "world_size": e.world_size} for e in svc.fleet.engines]

    @app.post("/v1/pause")
    async def pause(req: PauseRequest) -> dict[str, Any]:
        return await svc.pause(req)

    @app.post("/v1/resume")
    async def resume(req: ResumeRequest) -> dict[str, Any]:
        return await svc.resume(req)

    async def generate_batch_route(request: Request) -> Response:
        """POST /v1/generate_batch as a plain Starlette route (see the module docstring)."""
        try:
            req = BatchRequest.model_validate_json(await request.body())
        except ValidationError as e:   # FastAPI's 422, as for a body model
            raise RequestValidationError([{**er, "loc": ("body", *er["loc"])} for er in e.errors(include_url=False)])
        return Response(orjson.dumps(await generate_batch(req)), media_type="application/json")

    app.router.add_route("/v1/generate_batch", generate_batch_route, methods=["POST"])

    async def generate_batch(req: BatchRequest) -> dict[str, Any]:
        if cfg.rollout.mode != "on_demand":
            raise HTTPException(409, "generate_batch needs rollout.mode: on_demand (this service is continuous)")
        cap = svc.loop.admission_cap
        if req.groups > cap:
            raise HTTPException(422, f"groups {req.groups} is more than the admission cap {cap} "
                                     "((buffer.max_staleness + 1) x rollout.groups_per_step)")
        version = req.weight_version if req.weight_version is not None else await svc.engines_version()
        if version is not None and version != svc.gate.version:
            svc.fleet.set_version(version)
            svc.gate.version = version
        if svc.gate.paused:
            raise HTTPException(409, "the service is paused: POST /v1/resume first")
        return await svc.loop.generate_batch(req.groups)

    @app.post("/v1/load_adapter")
    async def load_adapter(req: LoadAdapterRequest) -> dict[str, Any]:
        """trainer.lora_sync adapter: load a PEFT directory on every engine as v<weight_version>
        (rollout.adapters); 502 naming each engine that failed, with nothing left loaded."""
        try:
            return await svc.adapters.load(req.path, req.weight_version)
        except AdapterError as e:
            raise HTTPException(502, {"message": str(e), "engines": e.engines}) from None

    @app.post("/v1/release_memory")
    async def release_memory(req: MemoryRequest) -> dict[str, Any]:
        return await svc.memory("/release_memory_occupation", req)

    @app.post("/v1/resume_memory")
    async def resume_memory(req: MemoryRequest) -> dict[str, Any]:
        return await svc.memory("/resume_memory_occupation", req)

    @app.post("/v1/evaluate")
    async def evaluate(req: EvalRequest) -> dict[str, Any]:
        try:
            return await svc.loop.evaluate(req.n, (req.part[0], req.part[1]) if req.part else None)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None

    return app
