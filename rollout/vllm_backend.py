"""SGLang's HTTP API in front of one vLLM 0.32 server: the translation layer of ``backend: vllm``.

Everything in Headrace talks to engines through SGLang's API (the fleet, the transport, the
trainer's weight sync, the engine contract suite). For ``rollout.engines.backend: vllm`` the fleet
starts one small adapter process per engine (this module, in Headrace's venv): it launches
``<engines.python> -m vllm.entrypoints.openai.api_server`` on a private loopback port (or attaches
to an external vLLM URL with ``--upstream``) and serves SGLang's routes on the engine's port,
translating each call. vLLM itself runs in its own venv and is reached only over HTTP.

Guarantees:
- ``/generate`` (token ids or text, one or a batch, per-prompt sampling params, ``n``) answers
  SGLang's shapes: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "weight_version", "output_token_logprobs": [[logprob, id, None], ...]}}``.
  One vLLM ``/inference/v1/generate`` request per prompt; SGLang's sampling keys map to vLLM's
  (``max_new_tokens`` -> ``max_tokens``, ``min_new_tokens`` -> ``min_tokens``, ``stop``,
  ``stop_token_ids``, ``ignore_eos``, ``seed``, ``n``, ...); an unknown key is a 400 naming it.
  SGLang's ``stream``, ``return_hidden_states``, ``return_text_in_logprobs``, ``model``, ... are
  accepted only at values that change nothing (``vllm_request.INERT_KEYS``: sglang-router sends
  them with every request, at SGLang's defaults); another value is a 400 naming the key.
  Logprobs are of the tempered distribution (vLLM runs with ``--logprobs-mode processed_logprobs``).
- ``/abort_request {"rid"}`` / ``{"abort_all": true}`` abort by vLLM's *internal* ids
  (``generate-tokens-<request_id>``; a plain id aborts nothing while vLLM answers 200); the caller
  gets the partial tokens and logprobs with ``finish_reason {"type": "abort"}``.
- ``/pause_generation``: ``abort`` -> vLLM ``/pause?mode=abort``; ``in_place`` -> ``mode=keep``;
  ``retract`` (which vLLM lacks) -> ``keep`` too, and a request aborted while so paused is answered
  as SGLang answers from its waiting queue (no ``prompt_tokens``). Requests sent while paused wait
  here until ``/continue_generation``, as in SGLang's waiting queue: an abort (by rid or
  ``abort_all``) answers a held request at once with no tokens, ``finish_reason`` abort and no
  ``prompt_tokens`` (a pause in abort mode then drains every request, also one that arrived after
  it); ``/health`` answers 503 while paused (SGLang's /health cannot
  generate then), ``/get_model_info`` stays 200.
- A launched vLLM that exits stops the adapter (status 3: the fleet restarts it; ``vllm_launch``).
- Start-up checks (exit 2 with one line naming the URL and the fix): the upstream must be vLLM
  (``/version``), of the supported version, in dev mode (its RL routes answer), serving the model,
  with Headrace's weight-transfer engine (``--weight-transfer-config '{"backend": "headrace"}'``).
- Weight updates: ``rollout.vllm_weights`` (SGLang's update-group routes over vLLM's weight
  transfer routes and Headrace's ``headrace`` transfer engine, a vLLM plugin). Memory: ``/release_memory_occupation`` ->
  ``/sleep``, ``/resume_memory_occupation`` -> ``/wake_up`` (on CPU vLLM frees nothing).
- With ``HEADRACE_TOKEN`` set, every route but /health needs the bearer token, and vLLM is
  launched with it as ``VLLM_API_KEY``; measured: that key guards only /v1, /v2, /inference and
  /cohere, while the dev-mode RL routes and ``/collective_rpc`` answer without it, so a launched
  vLLM binds 127.0.0.1 only. Bodies are bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from headrace.rollout.vllm_request import BadRequest, check_generate_keys, finish_reason, to_vllm_sampling
from headrace.shared.auth import TOKEN_ENV, Guard, BearerAuth, bearer_headers
from headrace.shared.procs import free_port
from headrace.rollout.vllm_launch import CHILD_DIED, load_tokenizer, vllm_command, vllm_env, wait_started, watch_child

log = logging.getLogger("headrace.rollout.vllm")
SUPPORTED = "0.32"
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}
MAX_BATCH = 1024
MAX_BODY = 64 << 20


class Adapter:
    """The state behind the routes: the upstream URL, requests in flight, pause."""

    def __init__(self, upstream: str, model: str, token: str | None, tokenizer: Any = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), headers=bearer_headers(token),
                                      limits=httpx.Limits(max_connections=4096, max_keepalive_connections=64))
        self.in_flight: dict[str, str] = {}   # SGLang rid -> vLLM request_id
        self.aborted: set[str] = set()        # request ids aborted through us (answers say abort)
        self.retracted: set[str] = set()      # ... while paused in retract mode (no prompt_tokens)
        self.held: dict[str, asyncio.Event] = {}   # SGLang rid -> set when aborted while held here
        self.open = asyncio.Event()
        self.open.set()
        self.weights_ready = asyncio.Event()   # cleared inside a weight-update session
        self.weights_ready.set()
        self.pause_mode: str | None = None
        self.weight_version = "0"

    async def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return await self.http.request(method, f"{self.upstream}{path}", **kw)

    async def check_upstream(self) -> str | None:
        """Why the upstream is not a usable vLLM server (None when it is)."""
        try:
            r = await self.call("GET", "/version", timeout=10.0)
        except httpx.HTTPError as e:
            return f"cannot reach {self.upstream}: {type(e).__name__}: {e}"
        version = r.json().get("version") if r.status_code == 200 and "json" in r.headers.get("content-type", "") else None
        if not isinstance(version, str):
            return (f"{self.upstream} is not a vLLM server (GET /version answered {r.status_code}); "
                    "point rollout.engines.urls at a vLLM OpenAI API server")
        if not version.startswith(SUPPORTED):
            return (f"{self.upstream} runs vLLM {version}; Headrace supports vLLM {SUPPORTED}.x "
                    f"(bash scripts/build_vllm_venv.sh builds it)")
        r = await self.call("GET", "/is_paused", timeout=10.0)
        if r.status_code == 404:
            return (f"{self.upstream} is vLLM {version} without dev mode (its RL routes are missing): "
                    "start it with VLLM_SERVER_DEV_MODE=1")
        r = await self.call("GET", "/inference/v1/generate", timeout=10.0)   # 405 when the route exists
        if r.status_code == 404:
            return (f"{self.upstream} is vLLM {version} without the token-in route /inference/v1/generate: "
                    "start it with --enable-scale-out")
        r = await self.call("GET", "/v1/models", timeout=10.0)
        served = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
        if self.model not in served and Path(self.model).name not in served:
            return (f"{self.upstream} serves {served or 'no model'}, not {self.model} (the model the trainer "
                    f"loads and syncs): start vLLM with --model {self.model}")
        from headrace.rollout.vllm_weights import check_weight_transfer
        return await check_weight_transfer(self)

    # ---- /generate ----

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        ids, text = body.get("input_ids"), body.get("text")
        if (ids is None) == (text is None):
            raise BadRequest("give exactly one of input_ids and text")
        if text is not None:
            if self.tokenizer is None:
                raise BadRequest("text prompts need the model's tokenizer, which did not load")
            single = isinstance(text, str)
            texts = [text] if single else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a list of strings")
            return [self.tokenizer.encode(t) for t in texts], single
        single = bool(ids) and all(isinstance(t, int) for t in ids) if isinstance(ids, list) else False
        prompts = [ids] if single else ids
        if not isinstance(prompts, list) or not prompts:
            raise BadRequest("input_ids must be a non-empty list of token ids or of such lists")
        for p in prompts:
            if not (isinstance(p, list) and p and all(type(t) is int and 0 <= t < 2**31 for t in p)):
                raise BadRequest("input_ids: each prompt must be a non-empty list of integer token ids in [0, 2^31)")
        return prompts, single

    async def generate(self, body: dict[str, Any]) -> Any:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        check_generate_keys(body)
        lora = body.get("lora_path")
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise BadRequest("lora_path must be the name of a loaded adapter (a non-empty string)")
        prompts, single = self._prompts(body)
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        if len(sps) != len(prompts):
            raise BadRequest(f"{len(sps)} sampling_params for {len(prompts)} prompts")
        params = [to_vllm_sampling(sp) for sp in sps]
        if sum(p.get("n", 1) for p in params) > MAX_BATCH:
            raise BadRequest(f"more than {MAX_BATCH} sequences (prompts x n) in one request")
        rids = body.get("rid")
        rids = [rids] if isinstance(rids, str) else rids
        if rids is not None and (not isinstance(rids, list) or len(rids) != len(prompts)):
            raise BadRequest("rid must be a string, or a list with one per prompt")
        logprob = bool(body.get("return_logprob", False))
        rids = rids or [uuid.uuid4().hex for _ in prompts]
        if await self._hold(rids):
            outs = [self._held_abort(rid, sp, logprob) for rid, sp in zip(rids, params)]
        else:
            outs = await asyncio.gather(*(self._one(p, sp, rid, logprob, lora)
                                          for p, sp, rid in zip(prompts, params, rids)))
        flat = [r for rs in outs for r in rs]
        return flat[0] if single and len(flat) == 1 else flat

    def _ready(self) -> bool:
        return self.open.is_set() and self.weights_ready.is_set()

    async def _hold(self, rids: list[str]) -> bool:
        """Wait while paused or inside a weight update; True when the request was aborted meanwhile."""
        if self._ready():
            return False
        aborted = asyncio.Event()
        for rid in rids:
            self.held[rid] = aborted
        try:
            while not self._ready() and not aborted.is_set():
                waits = [asyncio.ensure_future(e.wait()) for e in (self.open, self.weights_ready, aborted)
                         if not e.is_set()]
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
        finally:
            for rid in rids:
                if self.held.get(rid) is aborted:
                    del self.held[rid]
        return aborted.is_set()

    def _held_abort(self, rid: str, sp: dict[str, Any], logprob: bool) -> list[dict[str, Any]]:
        """SGLang's answer to a request aborted in its waiting queue: no tokens, no prompt_tokens."""
        n = sp.get("n", 1)
        answers = []
        for i in range(n):
            meta: dict[str, Any] = {"id": f"{rid}-{i}" if n > 1 else rid, "finish_reason": {"type": "abort"},
                                    "completion_tokens": 0, "cached_tokens": 0, "weight_version": self.weight_version}
            if logprob:
                meta["output_token_logprobs"] = []
            answers.append({"text": "", "output_ids": [], "meta_info": meta})
        return answers

    async def _one(self, prompt: list[int], sp: dict[str, Any], rid: str, logprob: bool,
                   lora: str | None = None) -> list[dict[str, Any]]:
        req_id = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.in_flight[rid] = req_id
        try:
            r = await self.call("POST", "/inference/v1/generate", json={
                "request_id": req_id, "token_ids": prompt, "sampling_params": sp, "model": lora or self.model,
                "output_mode": "tokens"})
        finally:
            if self.in_flight.get(rid) == req_id:
                del self.in_flight[rid]
        if r.status_code != 200:
            raise UpstreamError(r.status_code, r.text[:500])
        aborted = req_id in self.aborted
        retracted = req_id in self.retracted
        self.aborted.discard(req_id)
        self.retracted.discard(req_id)
        answers = []
        for i, c in enumerate(r.json()["choices"]):
            ids = list(c.get("token_ids") or [])
            fr = finish_reason(c, sp["max_tokens"], aborted)
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            if fr["type"] == "stop" and isinstance(fr["matched"], str) and fr["matched"] in text:
                text = text[:text.index(fr["matched"])]
            meta: dict[str, Any] = {"id": f"{rid}-{i}" if sp.get("n", 1) > 1 else rid, "finish_reason": fr,
                                    "prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                    "cached_tokens": 0, "weight_version": self.weight_version}
            if retracted and fr["type"] == "abort":
                del meta["prompt_tokens"]   # SGLang answers an abort from its waiting queue without it
            if logprob:
                content = (c.get("logprobs") or {}).get("content") or []
                if len(content) != len(ids):
                    raise UpstreamError(502, f"vLLM gave {len(content)} logprobs for {len(ids)} tokens")
                meta["output_token_logprobs"] = [[min(0.0, float(x["logprob"])), t, None]
                                                 for x, t in zip(content, ids)]
            answers.append({"text": text, "output_ids": ids, "meta_info": meta})
        return answers

    # ---- abort, pause ----

    async def abort(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("abort_all"):
            targets = list(self.in_flight.values())
            held = list(self.held.values())
        elif isinstance(body.get("rid"), str):
            targets = [v for k, v in self.in_flight.items() if k == body["rid"]]
            held = [e for k, e in self.held.items() if k == body["rid"]]
        else:
            raise BadRequest("give rid (a string) or abort_all: true")
        # one line per abort: what it found is what tells a lost race from a missed abort
        log.info("abort %s: %d in flight, %d held", "all" if body.get("abort_all") else body["rid"],
                 len(targets), len(held))
        for e in held:   # held here (paused): answered at once, as from SGLang's waiting queue
            e.set()
        await self._abort(targets)
        return {"aborted": len(targets) + len(held)}

    async def _abort(self, req_ids: list[str]) -> None:
        if not req_ids:
            return
        self.aborted.update(req_ids)
        if self.pause_mode == "retract":
            self.retracted.update(req_ids)
        r = await self.call("POST", "/abort_requests", json={"request_ids": [f"generate-tokens-{i}" for i in req_ids]})
        if r.status_code != 200:
            raise UpstreamError(r.status_code, r.text[:500])

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        self.open.clear()
        self.pause_mode = mode
        if mode == "abort":
            await self._abort(list(self.in_flight.values()))
        r = await self.call("POST", f"/pause?mode={PAUSE_MODES[mode] if mode != 'abort' else 'keep'}")
        if r.status_code != 200:
            raise UpstreamError(r.status_code, r.text[:500])

    async def resume(self) -> None:
        r = await self.call("POST", "/resume")
        if r.status_code != 200:
            raise UpstreamError(r.status_code, r.text[:500])
        self.pause_mode = None
        self.open.set()


class UpstreamError(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"vLLM answered {status}: {text}")
        self.status = status


def build_app(adapter: Adapter, token: str | None) -> FastAPI:
    """The FastAPI app serving SGLang's routes for ``adapter``."""
    from headrace.rollout.vllm_weights import add_weight_routes

    app = FastAPI()
    app.state.adapter = adapter

    async def body_of(request: Request) -> Any:
        try:
            return await request.json() if await request.body() else {}
        except ValueError:
            raise BadRequest("the body is not valid JSON") from None

    @app.exception_handler(BadRequest)
    async def bad(_: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e)}}, status_code=400)

    @app.exception_handler(UpstreamError)
    async def upstream(_: Request, e: UpstreamError) -> JSONResponse:
        code = e.status if 400 <= e.status < 500 else 502
        return JSONResponse({"error": {"message": str(e)}}, status_code=code)

    @app.exception_handler(httpx.HTTPError)
    async def unreachable(_: Request, e: httpx.HTTPError) -> JSONResponse:
        return JSONResponse({"error": {"message": f"vLLM unreachable: {type(e).__name__}: {e}"}}, status_code=503)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> JSONResponse:
        if not adapter.open.is_set():
            return JSONResponse({"status": "paused"}, status_code=503)
        r = await adapter.call("GET", "/health", timeout=10.0)
        return JSONResponse({"status": "ok" if r.status_code == 200 else "down"},
                            status_code=200 if r.status_code == 200 else 503)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": adapter.model, "is_generation": True, "weight_version": adapter.weight_version,
                "backend": "vllm"}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {"tp_size": 1, "backend": "vllm", "upstream": adapter.upstream, "weight_version": adapter.weight_version}

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        return await adapter.generate(await body_of(request))

    @app.post("/abort_request")
    async def abort(request: Request) -> Any:
        return await adapter.abort(await body_of(request))

    @app.post("/pause_generation")
    async def pause(request: Request) -> Any:
        await adapter.pause((await body_of(request)).get("mode", "abort"))
        return {"status": "paused"}

    @app.post("/continue_generation")
    async def resume() -> Any:
        await adapter.resume()
        return {"status": "ok"}

    @app.post("/flush_cache")
    async def flush() -> Any:
        r = await adapter.call("POST", "/reset_prefix_cache")
        return JSONResponse({"success": r.status_code == 200}, status_code=200 if r.status_code == 200 else 502)

    @app.post("/release_memory_occupation")
    async def release() -> Any:
        r = await adapter.call("POST", "/sleep?level=1")
        return JSONResponse({"success": r.status_code == 200, "note": "on CPU vLLM's /sleep frees nothing"},
                            status_code=200 if r.status_code == 200 else 502)

    @app.post("/resume_memory_occupation")
    async def wake() -> Any:
        r = await adapter.call("POST", "/wake_up")
        return JSONResponse({"success": r.status_code == 200}, status_code=200 if r.status_code == 200 else 502)

    add_weight_routes(app, adapter, body_of)
    guard = Guard(token)
    if guard.active:
        app.add_middleware(BearerAuth, guard=guard)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m headrace.rollout.vllm_backend",
                                 description="serve SGLang's API for one vLLM server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--python", help="python of the vLLM venv: launch vLLM (else --upstream)")
    ap.add_argument("--upstream", help="URL of a vLLM server started elsewhere")
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: extra vLLM arguments")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s vllm-adapter %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if (a.python is None) == (a.upstream is None):
        ap.error("give exactly one of --python (launch vLLM) and --upstream (attach)")
    from headrace.shared.serving import BodyLimit, serve, watch_parent

    token = os.environ.get(TOKEN_ENV) or None
    proc = None
    if a.python:
        port = free_port()
        extra = [x for x in a.vllm_args if x != "--"]
        cmd = vllm_command(a.python, a.model, port, extra)
        log.info("launching %s", " ".join(cmd))
        from headrace.rollout.fleet import die_with_parent
        proc = subprocess.Popen(cmd, env=vllm_env(token), preexec_fn=die_with_parent())   # SIGTERM when we die
        upstream = f"http://127.0.0.1:{port}"
        why = wait_started(proc, f"{upstream}/health", a.startup_timeout_s)
        if why:
            print(f"vllm adapter: vLLM did not start: {why}", file=sys.stderr)
            proc.terminate()
            return 2
    else:
        upstream = a.upstream
    adapter = Adapter(upstream, a.model, token)
    why = asyncio.run(adapter.check_upstream())
    if why:
        print(f"vllm adapter: {why}", file=sys.stderr)
        if proc is not None:
            proc.terminate()
        return 2
    adapter.tokenizer = load_tokenizer(a.model)   # after the check: importing transformers takes seconds
    adapter.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), headers=bearer_headers(token),
                                     limits=httpx.Limits(max_connections=4096, max_keepalive_connections=64))
    if a.parent_pid:
        watch_parent(a.parent_pid)
    stopping = threading.Event()
    if proc is not None:
        watch_child(proc, stopping)
    try:
        serve(BodyLimit(build_app(adapter, token), MAX_BODY, "vllm adapter"), a.host, a.port, name="vllm-adapter")
    finally:
        stopping.set()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 3 if CHILD_DIED.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
