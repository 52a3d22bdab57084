"""Weight and memory endpoints of the reference engine, with SGLang 0.5.23's names and rules.

Guarantees:
- The weight-update group and session (``/init_weights_update_group``, ``/begin_weight_update``,
  ``/update_weights_from_distributed``, ``/end_weight_update``, ``/destroy_weights_update_group``)
  are ``rollout.engine.session.UpdateSession`` over ``SchedulerTarget``: while a session is open
  the scheduler runs no step, so no token is generated with a mix of old and new tensors; received
  tensors are copied in on the scheduler thread (``DecoderModel.load_weights``) together with the
  weight version. A failed update leaves ``session.broken`` set and the engine refusing
  ``/generate`` (503) until a later session or a disk load succeeds.
- ``/update_weights_from_disk`` loads every weight of a HF directory (all checked before any is
  copied), only from the directories ``rollout.engine.confine.WeightDirs`` allows: anything else is
  a 403 with one fixed message, whatever the path. ``/release_memory_occupation`` really frees memory on CPU: tag ``weights`` writes the
  weights to a temporary safetensors file and drops the tensors, tag ``kv_cache`` retracts the
  running requests and drops the cache; ``/resume_memory_occupation`` reloads them.
- ``/get_weights_by_name`` returns a weight (first ``truncate_size`` rows) by its HF name.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from headrace.rollout.engine.confine import REFUSED, Refused, WeightDirs
from headrace.rollout.engine.http import answer, json_body, json_response
from headrace.rollout.engine.model import DecoderModel, iter_safetensors
from headrace.rollout.engine.scheduler import Scheduler
from headrace.rollout.engine.session import UpdateSession
from headrace.rollout.engine.weight_routes import add_weight_routes

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineState(Protocol):
    """What these endpoints use of the engine (``rollout.engine.server.Engine``)."""

    model_path: str
    model: DecoderModel
    scheduler: Scheduler


class SchedulerTarget:
    """The reference engine's model as the session's ``WeightTarget``: every change runs on the
    scheduler thread, between two steps."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def _on_scheduler(self, fn: Callable[[], Any]) -> Any:
        return self.scheduler.call(fn).result()

    def set_updating(self, updating: bool) -> None:
        self._on_scheduler(lambda: setattr(self.scheduler, "updating", updating))

    def param_view(self, name: str) -> torch.Tensor | None:
        return self.scheduler.model.param_view(name)

    def load(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        self._on_scheduler(lambda: self.scheduler.load_weights(named, version))

    def abort_all(self, reason: str) -> None:
        self._on_scheduler(lambda: self.scheduler.abort(None, reason))

    def flush_cache(self) -> None:
        self._on_scheduler(self.scheduler.flush_cache)


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
    """The weight-update session, disk loads and released memory of one reference engine."""

    def __init__(self, engine: EngineState, timeout_s: float, weight_dirs: WeightDirs) -> None:
        self.engine = engine
        self.weight_dirs = weight_dirs
        self.session = UpdateSession(SchedulerTarget(engine.scheduler), timeout_s=timeout_s)
        self.stash_dir: str | None = None

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.scheduler.call(fn))

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

    # ---- endpoints --------------------------------------------------------------------------

    async def from_disk(self, body: dict[str, Any]) -> Response:
        try:
            path = _field(body, "model_path", str)
            version = _field(body, "weight_version", str, None)
            abort_all = _field(body, "abort_all_requests", bool, False)
        except ValueError as e:
            return answer(False, f"update_weights_from_disk: {e}", num_paused_requests=0)
        model, sch = self.engine.model, self.engine.scheduler
        if sch.released:
            return answer(False, "memory is released: resume it before updating weights", num_paused_requests=0)
        try:
            named = await asyncio.to_thread(lambda: list(self.weight_dirs.load(path)))
        except Refused:
            return json_response({"success": False, "message": REFUSED, "num_paused_requests": 0}, 403)
        except Exception as e:  # noqa: BLE001
            return answer(False, f"Failed to update weights from {path}: {e}", num_paused_requests=0)
        try:
            have = {n for n, _ in named}
            missing = [n for n in model.hf_names() if n not in have]
            if missing:
                raise ValueError(f"{len(missing)} weights missing, e.g. {missing[:3]}")
            if abort_all:
                await self._run(lambda: sch.abort(None, "Abort by update_weights_from_disk"))
            await self._run(lambda: sch.load_weights(named, version))
        except Exception as e:  # noqa: BLE001
            return answer(False, f"Failed to update weights from {path}: {e}", num_paused_requests=0)
        self.engine.model_path = path
        self.session.whole_model_loaded()
        await self._run(sch.flush_cache)
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return answer(True, msg, num_paused_requests=0)

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
            return answer(False, str(e))
        sch = self.engine.scheduler
        await self._run(lambda: sch.release(tags, self._stash))
        return answer(True, f"Released {', '.join(sorted(sch.released)) or 'nothing'}.")

    async def resume(self, body: dict[str, Any]) -> Response:
        try:
            tags = self._tags(body)
        except ValueError as e:
            return answer(False, str(e))
        sch = self.engine.scheduler
        await self._run(lambda: sch.resume_memory(tags, self._unstash))
        return answer(True, f"Resumed; still released: {', '.join(sorted(sch.released)) or 'nothing'}.")

    async def weights_by_name(self, body: dict[str, Any]) -> Response:
        name = body.get("name")
        size = body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(size, int) or size < 1:
            return json_response({"error": {"message": "name (string) and truncate_size (int >= 1) required"}}, 400)
        try:
            t = await self._run(lambda: self.engine.model.get_weight(name)[:size].float().tolist())
        except KeyError as e:
            return json_response({"error": {"message": str(e)}}, 400)
        return json_response(t)

    def register(self, app: FastAPI) -> None:
        add_weight_routes(app, self.session)
        app.add_api_route("/update_weights_from_disk", _endpoint(self.from_disk), methods=["POST"])
        for path, handler in {"/release_memory_occupation": self.release, "/resume_memory_occupation": self.resume,
                              "/get_weights_by_name": self.weights_by_name}.items():
            app.add_api_route(path, _endpoint(handler), methods=["GET", "POST"])


def _endpoint(handler: Callable[[dict[str, Any]], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            body = await json_body(request)
        except ValueError as e:
            return json_response({"error": {"message": str(e)}}, 400)
        if not isinstance(body, dict):
            return answer(False, "the body must be a JSON object")
        return await handler(body)

    return endpoint
