"""SGLang's weight-update routes for a vLLM engine (the adapter of ``rollout.vllm_backend``), carried
over vLLM's own weight-transfer routes.

The trainer's ``WeightSender`` speaks SGLang's protocol (``shared.weight_sync.protocol``) to every
engine; this module maps each step onto vLLM 0.32's dev-mode weight-transfer routes, which vLLM's
worker hands to its weight-transfer engine. On CPU (and on GPU with our group) that engine is
Headrace's ``headrace`` backend (``scripts/vllm_ext/headrace_vllm_ext/transfer.py``, a
``vllm.general_plugins`` entry point installed in the vLLM venv; vLLM runs with
``--weight-transfer-config '{"backend": "headrace"}'``), which joins our update group exactly as
``shared.weight_sync.group.join_update_group`` does. No step uses ``/collective_rpc``.

| SGLang route (here) | vLLM route |
| --- | --- |
| ``/init_weights_update_group`` | ``/shutdown_weight_transfer_engine`` (a stale group), ``/init_weight_transfer_engine {"init_info"}`` |
| ``/begin_weight_update`` | ``/start_weight_update`` |
| ``/update_weights_from_distributed`` | ``/update_weights {"update_info": {names, dtype_names, shapes, load_format, weight_version}}`` |
| ``/end_weight_update`` | ``/finish_weight_update {"weight_version"}``, then ``GET /weight_info`` |
| ``/destroy_weights_update_group`` | ``/shutdown_weight_transfer_engine`` |
| ``/update_weight_version``, ``/get_weight_version`` | ``/update_weight_version``, the version read back from ``/weight_info`` |

One session state machine, used by every route:
- ``/init_weights_update_group`` joins the group (400 if one is open); ``/destroy_weights_update_group``
  leaves it (400 if none, or another name), ending vLLM's session first if one is open;
- ``/begin_weight_update`` opens a session (400 if open): generation requests wait until it ends;
- ``/update_weights_from_distributed`` (inside a session, else 400) receives one bucket into the
  engine's staging area; the model is not touched yet. A failed bucket ends vLLM's session (vLLM
  does so itself) and empties the staging area; this session stays open (no generation) until the
  trainer's full re-push, whose first step ends it;
- ``/end_weight_update`` applies the update only if its last bucket (the one carrying
  ``weight_version``) arrived: ``/finish_weight_update`` loads every staged tensor in one step
  (restoring the old tensors if loading fails; re-packing a tied output head) and only then sets
  vLLM's version. Otherwise the staged tensors are discarded (``{"discard": true}``) and vLLM's
  session ends with nothing applied. A failed finish ends vLLM's session too (a second, empty
  ``/finish_weight_update``), so the engine keeps serving exactly one version.
- The version this adapter reports is the one vLLM's ``/weight_info`` answers: adopted at start-up
  (a fresh vLLM's ``"default"`` becomes ``"0"``) and read back after every finish.
LoRA (``trainer.lora_sync: adapter``): ``/load_lora_adapter`` and ``/unload_lora_adapter`` map to
vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM needs ``--enable-lora`` in
``engines.args`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, which the adapter sets); ``lora_path``
in ``/generate`` becomes the request's ``model``.
Errors are ``{"success": false, "message"}`` with 400 (protocol misuse) or 500 (vLLM failed).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from headrace.shared.weight_sync.protocol import (DestroyGroupRequest, InitGroupRequest, UpdateBucketRequest,
                                                  parse)

TRANSFER_BACKEND = "headrace"
RPC_TIMEOUT_S = 600.0
FRESH_VERSION = "default"   # what vLLM's /weight_info answers before any version was set
DISCARD = {"names": [], "dtype_names": [], "shapes": [], "discard": True}


def _fail(message: str, status: int) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


def _answer(r: Any) -> JSONResponse:
    """SGLang's ``{"success", "message"}`` for a vLLM answer (400 when vLLM refused)."""
    if r.status_code == 200:
        return JSONResponse({"success": True, "message": r.text[:500]})
    return _fail(f"vLLM answered {r.status_code}: {r.text[:500]}", 400)


async def upstream_version(adapter: Any) -> str:
    """vLLM's weight version (``GET /weight_info``); RuntimeError if it does not answer one."""
    r = await adapter.call("GET", "/weight_info", timeout=30.0, headers={"Connection": "close"})
    v = r.json().get("weight_version") if r.status_code == 200 else None
    if not isinstance(v, str):
        raise RuntimeError(f"vLLM GET /weight_info answered {r.status_code}: {r.text[:300]}")
    return v


async def check_weight_transfer(adapter: Any) -> str | None:
    """Why ``adapter``'s vLLM cannot take Headrace's weight updates (None when it can); adopts its
    weight version (a fresh vLLM's ``"default"`` is set to ``adapter.weight_version``)."""
    r = await adapter.call("GET", "/server_info", params={"config_format": "json"}, timeout=60.0)
    if r.status_code == 200:
        cfg = (r.json().get("vllm_config") or {}).get("weight_transfer_config") or {}
        if cfg.get("backend") != TRANSFER_BACKEND:
            return (f"{adapter.upstream} runs without Headrace's weight-transfer engine (weight_transfer_config "
                    f"{cfg or None}): start it with --weight-transfer-config '{{\"backend\": \"{TRANSFER_BACKEND}\"}}' "
                    "from a venv built by scripts/build_vllm_venv.sh (it installs the headrace_vllm_ext plugin)")
    try:
        v = await upstream_version(adapter)
    except (RuntimeError, ValueError) as e:
        return f"{adapter.upstream} does not report its weight version ({e}): is it a vLLM 0.32 server in dev mode?"
    if v == FRESH_VERSION:
        r = await adapter.call("POST", "/update_weight_version", json={"new_version": adapter.weight_version})
        if r.status_code != 200:
            return f"{adapter.upstream}: POST /update_weight_version answered {r.status_code}: {r.text[:300]}"
    else:
        adapter.weight_version = v
    return None


class WeightSession:
    """The update-group and session state of one vLLM engine (see the module docstring)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.group: str | None = None
        self.open = False               # our session: generation waits
        self.upstream_open = False      # vLLM's session (between start and finish)
        self.complete: str | None = None   # the version of a last bucket received in this session

    async def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST to a vLLM weight-transfer route; its answer, or RuntimeError naming the route. Each on
        its own connection: vLLM drops a connection after a route raised, and a pooled one would
        fail the next request."""
        r = await self.adapter.call("POST", path, json=body if body is not None else {}, timeout=RPC_TIMEOUT_S + 30,
                                    headers={"Connection": "close"})
        if r.status_code != 200:
            raise RuntimeError(f"vLLM {path} answered {r.status_code}: {r.text[:800]} (vLLM's log has the cause)")
        return r

    async def end_upstream(self, version: str | None) -> None:
        """End vLLM's session: apply the staged update as ``version``, or (None) discard it."""
        if not self.upstream_open:
            return
        try:
            if version is None:
                await self.post("/update_weights", {"update_info": DISCARD})
            await self.post("/finish_weight_update", {} if version is None else {"weight_version": version})
        except BaseException:
            # vLLM keeps its session open after a failed finish; the engine's staging area is empty
            # by now, so an empty finish ends it with nothing applied
            await self.post("/finish_weight_update", {})
            raise
        finally:
            self.upstream_open = False


    async def abandon(self) -> None:
        """After a failed bucket: make sure vLLM's session is over with nothing applied. vLLM ends it
        itself when the engine raised; when the failure was elsewhere it may still be open, so discard
        and finish are sent regardless, and their refusals (no session) are expected."""
        self.upstream_open = False
        for path, body in (("/update_weights", {"update_info": DISCARD}), ("/finish_weight_update", {})):
            try:
                await self.post(path, body)
            except Exception:  # noqa: BLE001 - "no session" is the usual answer
                pass


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
        await s.end_upstream(None)
        await s.post("/shutdown_weight_transfer_engine")   # a group a previous adapter left behind
        await s.post("/init_weight_transfer_engine", {"init_info": {
            "master_address": req.master_address, "master_port": req.master_port, "rank_offset": req.rank_offset,
            "world_size": req.world_size, "group_name": req.group_name, "backend": req.backend,
            "timeout_s": RPC_TIMEOUT_S}})
        s.group = req.group_name
        return {"success": True, "message": f"joined {req.group_name}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> Any:
        req = await parsed(request, DestroyGroupRequest)
        if s.group is None or s.group != req.group_name:
            return _fail(f"no weight-update group named {req.group_name!r} (open: {s.group!r})", 400)
        s.group = None
        try:
            await s.end_upstream(None)   # vLLM refuses to shut down inside a session
        finally:
            await s.post("/shutdown_weight_transfer_engine")
        return {"success": True, "message": "destroyed"}

    @app.post("/begin_weight_update")
    async def begin() -> Any:
        if s.open:
            return _fail("a weight-update session is already open (end it first)", 400)
        s.open, s.complete = True, None
        adapter.weights_ready.clear()
        await s.end_upstream(None)
        await s.post("/start_weight_update")
        s.upstream_open = True
        return {"success": True, "message": "session open"}

    @app.post("/update_weights_from_distributed")
    async def bucket(request: Request) -> Any:
        req = await parsed(request, UpdateBucketRequest)
        if not s.open:
            return _fail("/update_weights_from_distributed outside a /begin_weight_update session", 400)
        if s.group is None or req.group_name != s.group:
            return _fail(f"no weight-update group named {req.group_name!r} (open: {s.group!r})", 400)
        if not s.upstream_open:
            return _fail("an earlier bucket of this update failed: end the session and push the whole update again", 400)
        info = {"names": req.names, "dtype_names": req.dtypes, "shapes": req.shapes,
                "load_format": "flattened_bucket" if req.load_format == "flattened_bucket" else None,
                "weight_version": req.weight_version}
        try:
            await s.post("/update_weights", {"update_info": info})
        except BaseException:
            s.complete = None
            await s.abandon()
            raise
        if req.weight_version is not None:
            s.complete = req.weight_version
        return {"success": True, "message": f"{len(req.names)} tensors received"}

    @app.post("/end_weight_update")
    async def end() -> Any:
        if not s.open:
            return _fail("no weight-update session is open", 400)
        version, s.complete = s.complete, None
        try:
            await s.end_upstream(version)
        finally:
            s.open = False
            try:
                adapter.weight_version = await upstream_version(adapter)
            finally:
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
        r = await adapter.call("POST", "/update_weight_version", json={"new_version": v})
        if r.status_code != 200:
            return _fail(f"vLLM /update_weight_version answered {r.status_code}: {r.text[:300]}", 500)
        adapter.weight_version = v
        return {"success": True, "message": f"weight_version {v}"}


class _Refused(ValueError):
    """A request body that does not parse (400)."""
