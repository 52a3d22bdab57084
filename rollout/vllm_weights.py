"""SGLang's weight-update routes for a vLLM engine (the adapter of ``rollout.vllm_backend``).

The trainer's ``WeightSender`` speaks SGLang's protocol (``shared.weight_sync.protocol``) to every
engine; for a vLLM engine these routes carry each step into the vLLM worker through vLLM's dev-mode
``/collective_rpc``, which calls methods of Headrace's worker extension
(``scripts/vllm_ext/headrace_vllm_ext``, installed in the vLLM venv, loaded with
``--worker-extension-cls``). The extension joins our update group exactly as
``shared.weight_sync.group.join_update_group`` does (gloo on CPU, NCCL on GPU).

One session state machine, used by every route:
- ``/init_weights_update_group`` joins the group (400 if one is open); ``/destroy_weights_update_group``
  leaves it (400 if none, or another name);
- ``/begin_weight_update`` opens a session (400 if open): generation requests wait until it ends;
- ``/update_weights_from_distributed`` (inside a session, else 400) receives one bucket into a
  staging area in the worker; the model is not touched yet;
- ``/end_weight_update`` loads the staged tensors into the model in one step, re-runs the
  post-load weight processing (vLLM's CPU backend keeps a pre-packed copy of a tied output head
  that an in-place load does not refresh), and restores the old tensors if loading fails, so the
  engine always serves exactly one version; only then does ``weight_version`` change. An update
  whose last bucket (the one carrying ``weight_version``) never arrived is discarded at ``end``.
- A failed bucket clears the staging area; the session stays open (no generation) until the
  trainer's full re-push, whose ``end`` ends it.
LoRA (``trainer.lora_sync: adapter``): ``/load_lora_adapter`` and ``/unload_lora_adapter`` map to
vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM needs ``--enable-lora`` in
``engines.args`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, which the adapter sets); ``lora_path``
in ``/generate`` becomes the request's ``model``.
Errors are ``{"success": false, "message"}`` with 400 (protocol misuse) or 500 (the worker failed).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from headrace.shared.weight_sync.protocol import (DestroyGroupRequest, InitGroupRequest, UpdateBucketRequest,
                                                  parse)

RPC_TIMEOUT_S = 600.0


def _fail(message: str, status: int) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


def _answer(r: Any) -> JSONResponse:
    """SGLang's ``{"success", "message"}`` for a vLLM answer (400 when vLLM refused)."""
    if r.status_code == 200:
        return JSONResponse({"success": True, "message": r.text[:500]})
    return _fail(f"vLLM answered {r.status_code}: {r.text[:500]}", 400)


class WeightSession:
    """The update-group and session state of one vLLM engine."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.group: str | None = None
        self.open = False

    async def rpc(self, method: str, **kwargs: Any) -> Any:
        """Call ``method`` of the worker extension on every vLLM worker; its results, or RuntimeError."""
        r = await self.adapter.call("POST", "/collective_rpc", timeout=RPC_TIMEOUT_S + 30,
                                    json={"method": method, "kwargs": kwargs, "timeout": RPC_TIMEOUT_S})
        if r.status_code != 200:
            raise RuntimeError(f"vLLM /collective_rpc {method} answered {r.status_code}: {r.text[:800]}")
        body = r.json()
        return body.get("results", body) if isinstance(body, dict) else body


def add_weight_routes(app: FastAPI, adapter: Any, body_of: Callable[[Request], Awaitable[Any]]) -> None:
    """Register the weight-update routes of ``adapter`` on ``app``."""
    s = WeightSession(adapter)
    app.state.weights = s

    async def parsed(request: Request, model: Any) -> Any:
        try:
            return parse(model, await body_of(request))
        except ValueError as e:
            raise _Refused(str(e)) from None

    @app.exception_handler(Exception)
    async def failed(_: Request, e: Exception) -> JSONResponse:
        if isinstance(e, _Refused):
            return _fail(str(e), 400)
        return _fail(f"{type(e).__name__}: {e}", 500)

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> Any:
        req = await parsed(request, InitGroupRequest)
        if s.group is not None:
            return _fail(f"a weight-update group ({s.group!r}) is already open: destroy it first", 400)
        await s.rpc("headrace_init_group", master_address=req.master_address, master_port=req.master_port,
                    rank_offset=req.rank_offset, world_size=req.world_size, group_name=req.group_name,
                    backend=req.backend, timeout_s=RPC_TIMEOUT_S)
        s.group = req.group_name
        return {"success": True, "message": f"joined {req.group_name}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> Any:
        req = await parsed(request, DestroyGroupRequest)
        if s.group is None or s.group != req.group_name:
            return _fail(f"no weight-update group named {req.group_name!r} (open: {s.group!r})", 400)
        s.group = None
        await s.rpc("headrace_destroy_group")
        return {"success": True, "message": "destroyed"}

    @app.post("/begin_weight_update")
    async def begin() -> Any:
        if s.open:
            return _fail("a weight-update session is already open (end it first)", 400)
        s.open = True
        adapter.weights_ready.clear()
        await s.rpc("headrace_begin")
        return {"success": True, "message": "session open"}

    @app.post("/update_weights_from_distributed")
    async def bucket(request: Request) -> Any:
        req = await parsed(request, UpdateBucketRequest)
        if not s.open:
            return _fail("/update_weights_from_distributed outside a /begin_weight_update session", 400)
        if s.group is None or req.group_name != s.group:
            return _fail(f"no weight-update group named {req.group_name!r} (open: {s.group!r})", 400)
        await s.rpc("headrace_receive", names=req.names, dtypes=req.dtypes, shapes=req.shapes,
                    load_format=req.load_format, weight_version=req.weight_version)
        return {"success": True, "message": f"{len(req.names)} tensors received"}

    @app.post("/end_weight_update")
    async def end() -> Any:
        if not s.open:
            return _fail("no weight-update session is open", 400)
        try:
            results = await s.rpc("headrace_apply")
            version = results[0] if isinstance(results, list) and results else None
            if version is not None:
                adapter.weight_version = str(version)
        finally:
            s.open = False
            adapter.weights_ready.set()
        return {"success": True, "message": "applied" if version is not None else "incomplete update discarded",
                "weight_version": adapter.weight_version}

    @app.post("/load_lora_adapter")
    async def load_lora(request: Request) -> Any:
        body = await body_of(request)
        if not (isinstance(body, dict) and isinstance(body.get("lora_name"), str) and isinstance(body.get("lora_path"), str)):
            return _fail("give lora_name and lora_path (strings)", 400)
        r = await adapter.call("POST", "/v1/load_lora_adapter", json={"lora_name": body["lora_name"],
                                                                       "lora_path": body["lora_path"]})
        return _answer(r)

    @app.post("/unload_lora_adapter")
    async def unload_lora(request: Request) -> Any:
        body = await body_of(request)
        if not (isinstance(body, dict) and isinstance(body.get("lora_name"), str)):
            return _fail("give lora_name (a string)", 400)
        return _answer(await adapter.call("POST", "/v1/unload_lora_adapter", json={"lora_name": body["lora_name"]}))

    @app.get("/get_weight_version")
    async def get_version() -> Any:
        return {"weight_version": adapter.weight_version}

    @app.post("/update_weight_version")
    async def set_version(request: Request) -> Any:
        body = await body_of(request)
        v = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(v, str) or not v:
            return _fail("new_version must be a non-empty string", 400)
        adapter.weight_version = v
        return {"success": True, "message": f"weight_version {v}"}


class _Refused(ValueError):
    """A request body that does not parse (400)."""
