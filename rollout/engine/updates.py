"""Weight and memory endpoints of the reference engine, with SGLang 0.5.23's names and rules.

Guarantees:
- ``/init_weights_update_group`` joins the trainer's process group through
  ``rollout.engine.weights.WeightReceiver`` (its ``init_group`` blocks on the rendezvous, so it
  runs in a worker thread); one group at a time; ``/destroy_weights_update_group`` leaves it.
- ``/update_weights_from_distributed`` is accepted only inside a ``/begin_weight_update`` ...
  ``/end_weight_update`` session (400 otherwise, as SGLang). While a session is open the
  scheduler runs no step, so no token is generated with a mix of old and new tensors. The
  receiver gets the tensors in ``names`` order in a worker thread; then the scheduler thread
  copies them in (``DecoderModel.load_weights``) and the weight version is set.
- A failed update inside a session leaves the engine refusing ``/generate`` (503) until a later
  session or disk load succeeds: a partial update is an error, never silently served.
- ``/update_weights_from_disk`` loads every weight of a HF directory (all checked before any is
  copied). ``/release_memory_occupation`` really frees memory on CPU: tag ``weights`` writes the
  weights to a temporary safetensors file and drops the tensors, tag ``kv_cache`` retracts the
  running requests and drops the cache; ``/resume_memory_occupation`` reloads them.
- ``/get_weights_by_name`` returns a weight (first ``truncate_size`` rows) by its HF name.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from headrace.rollout.engine.model import DecoderModel, iter_safetensors

if TYPE_CHECKING:
    from headrace.rollout.engine.server import Engine

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON answer serialised with orjson."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _answer(ok: bool, message: str, **extra: Any) -> Response:
    return json_response({"success": ok, "message": message, **extra}, 200 if ok else 400)


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in body or body[name] is None:
        if default is ...:
            raise ValueError(f"{name} is required")
        return default
    v = body[name]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ValueError(f"{name} has the wrong type ({type(v).__name__})")
    return v


class WeightUpdates:
    """State of the weight-update group, the update session and released memory."""

    def __init__(self, engine: "Engine", timeout_s: float) -> None:
        self.engine, self.timeout_s = engine, timeout_s
        self.receiver: Any = None
        self.group_name: str | None = None
        self.session_error: str | None = None
        self.stash_dir: str | None = None
        self._lock = asyncio.Lock()

    # ---- helpers ----------------------------------------------------------------------------

    def _stash(self, model: DecoderModel) -> None:
        from safetensors.torch import save_file

        self.stash_dir = tempfile.mkdtemp(prefix="headrace-engine-released-")
        save_file({n: t.contiguous().clone() for n, t in model.named_weights()},
                  str(Path(self.stash_dir) / "model.safetensors"))

    def _unstash(self, model: DecoderModel) -> None:
        assert self.stash_dir is not None, "resume without a stash"
        model.load_weights(iter_safetensors(self.stash_dir))
        shutil.rmtree(self.stash_dir, ignore_errors=True)
        self.stash_dir = None

    async def _set_session(self, open_: bool) -> None:
        sch = self.engine.scheduler
        await self.engine.run(lambda: setattr(sch, "updating", open_))

    # ---- endpoints --------------------------------------------------------------------------

    async def init_group(self, body: dict[str, Any]) -> Response:
        try:
            addr = _field(body, "master_address", str)
            port = _field(body, "master_port", int)
            rank_offset = _field(body, "rank_offset", int)
            world_size = _field(body, "world_size", int)
            group = _field(body, "group_name", str, "weight_update_group")
            backend = _field(body, "backend", str, "nccl")
        except ValueError as e:
            return _answer(False, f"init_weights_update_group: {e}")
        if self.receiver is not None:
            return _answer(False, f"a weight update group ({self.group_name}) already exists; destroy it first")
        if not 1 <= rank_offset < world_size:
            return _answer(False, f"rank_offset {rank_offset} must be in [1, world_size={world_size})")
        try:
            from headrace.rollout.engine.weights import WeightReceiver
        except ImportError as e:
            return _answer(False, f"weight receiver unavailable (rollout.engine.weights): {e}")
        receiver = WeightReceiver()
        try:
            await asyncio.to_thread(receiver.init_group, addr, port, rank_offset, world_size, group, backend,
                                    self.timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return _answer(False, f"Failed to init process group {group}: {e}")
        self.receiver, self.group_name = receiver, group
        return _answer(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, body: dict[str, Any]) -> Response:
        group = body.get("group_name") or "weight_update_group"
        if self.receiver is None or group != self.group_name:
            return _answer(False, f"no weight update group named {group!r}")
        receiver, self.receiver, self.group_name = self.receiver, None, None
        try:
            await asyncio.to_thread(receiver.destroy)
        except Exception as e:  # noqa: BLE001
            return _answer(False, f"destroying group {group} failed: {e}")
        return _answer(True, f"Succeeded to destroy process group {group}.")

    async def begin(self, body: dict[str, Any]) -> Response:
        if self.engine.scheduler.updating:
            return _answer(False, "a weight update session is already open; call /end_weight_update first")
        await self._set_session(True)
        self.session_error = None
        return _answer(True, "Weight update session started.")

    async def end(self, body: dict[str, Any]) -> Response:
        if not self.engine.scheduler.updating:
            return _answer(False, "no weight update session is open (call /begin_weight_update first)")
        await self._set_session(False)
        if self.session_error:
            return _answer(False, f"the session had a failed update: {self.session_error}")
        self.engine.broken = None
        return _answer(True, "Weight update session ended.")

    async def from_distributed(self, body: dict[str, Any]) -> Response:
        if not self.engine.scheduler.updating:
            return _answer(False, "update_weights_from_distributed outside a weight update session: "
                                  "call /begin_weight_update first")
        try:
            names = _field(body, "names", list)
            dtypes = _field(body, "dtypes", list)
            shapes = _field(body, "shapes", list)
            group = _field(body, "group_name", str, "weight_update_group")
            version = _field(body, "weight_version", str, None)
            load_format = _field(body, "load_format", str, None)
            flush = _field(body, "flush_cache", bool, True)
            abort_all = _field(body, "abort_all_requests", bool, False)
        except ValueError as e:
            return _answer(False, f"update_weights_from_distributed: {e}")
        if load_format is None and not (len(names) == len(dtypes) == len(shapes)):
            return _answer(False, f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        if self.receiver is None or group != self.group_name:
            return _answer(False, f"no weight update group named {group!r}: call /init_weights_update_group first")
        sch = self.engine.scheduler
        if abort_all:
            await self.engine.run(lambda: sch.abort(None, "Abort by update_weights_from_distributed"))
        async with self._lock:
            try:
                # per-tensor broadcasts land directly in the model's parameters (no decoding runs
                # inside a session, and a failed update leaves the engine refusing to serve anyway)
                named = await asyncio.to_thread(self.receiver.receive, names, dtypes, shapes, load_format,
                                                sch.model.param_view)
                await self.engine.run(lambda: sch.load_weights(named, version))
            except Exception as e:  # noqa: BLE001 - the update failed: refuse to serve a mix
                self.session_error = f"{type(e).__name__}: {e}"
                self.engine.broken = self.session_error
                return _answer(False, f"Failed to update parameter online: {self.session_error}")
        if flush:
            await self.engine.run(sch.flush_cache)
        msg = "Succeeded to update parameter online."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return _answer(True, msg)

    async def from_disk(self, body: dict[str, Any]) -> Response:
        try:
            path = _field(body, "model_path", str)
            version = _field(body, "weight_version", str, None)
            abort_all = _field(body, "abort_all_requests", bool, False)
        except ValueError as e:
            return _answer(False, f"update_weights_from_disk: {e}", num_paused_requests=0)
        model, sch = self.engine.model, self.engine.scheduler
        if sch.released:
            return _answer(False, "memory is released: resume it before updating weights", num_paused_requests=0)
        try:
            named = await asyncio.to_thread(lambda: list(iter_safetensors(path)))
            have = {n for n, _ in named}
            missing = [n for n in model.hf_names() if n not in have]
            if missing:
                raise ValueError(f"{len(missing)} weights missing, e.g. {missing[:3]}")
            if abort_all:
                await self.engine.run(lambda: sch.abort(None, "Abort by update_weights_from_disk"))
            await self.engine.run(lambda: sch.load_weights(named, version))
        except Exception as e:  # noqa: BLE001
            return _answer(False, f"Failed to update weights from {path}: {e}", num_paused_requests=0)
        self.engine.model_path = path
        self.engine.broken = None
        await self.engine.run(sch.flush_cache)
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return _answer(True, msg, num_paused_requests=0)

    def _tags(self, body: dict[str, Any]) -> set[str]:
        tags = body.get("tags")
        if tags is None:
            return {"weights", "kv_cache"}
        if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
            raise ValueError(f"tags must be a list of {', '.join(MEMORY_TAGS)}; got {tags!r}")
        return set(tags) - {"cuda_graph"}

    async def release(self, body: dict[str, Any]) -> Response:
        try:
            tags = self._tags(body)
        except ValueError as e:
            return _answer(False, str(e))
        sch = self.engine.scheduler
        await self.engine.run(lambda: sch.release(tags, self._stash))
        return _answer(True, f"Released {', '.join(sorted(sch.released)) or 'nothing'}.")

    async def resume(self, body: dict[str, Any]) -> Response:
        try:
            tags = self._tags(body)
        except ValueError as e:
            return _answer(False, str(e))
        sch = self.engine.scheduler
        await self.engine.run(lambda: sch.resume_memory(tags, self._unstash))
        return _answer(True, f"Resumed; still released: {', '.join(sorted(sch.released)) or 'nothing'}.")

    async def weights_by_name(self, body: dict[str, Any]) -> Response:
        name = body.get("name")
        size = body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(size, int) or size < 1:
            return json_response({"error": {"message": "name (string) and truncate_size (int >= 1) required"}}, 400)
        try:
            t = await self.engine.run(lambda: self.engine.model.get_weight(name)[:size].float().tolist())
        except KeyError as e:
            return json_response({"error": {"message": str(e)}}, 400)
        return json_response(t)

    def register(self, app: FastAPI, read_json: Callable[[Request], Awaitable[Any]]) -> None:
        routes = {"/init_weights_update_group": self.init_group, "/destroy_weights_update_group": self.destroy_group,
                  "/begin_weight_update": self.begin, "/end_weight_update": self.end,
                  "/update_weights_from_distributed": self.from_distributed,
                  "/update_weights_from_disk": self.from_disk,
                  "/release_memory_occupation": self.release, "/resume_memory_occupation": self.resume,
                  "/get_weights_by_name": self.weights_by_name}
        for path, handler in routes.items():
            post_only = "weight" in path and "memory" not in path and "by_name" not in path
            app.add_api_route(path, _endpoint(handler, read_json), methods=["POST"] if post_only else ["GET", "POST"])


def _endpoint(handler: Callable[[dict[str, Any]], Awaitable[Any]],
              read_json: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
    async def endpoint(request: Request) -> Any:
        body = await read_json(request)
        if not isinstance(body, dict):
            return _answer(False, "the body must be a JSON object")
        return await handler(body)

    return endpoint
