"""SGLang 0.5.23's LoRA endpoints on the reference engine: ``/load_lora_adapter``,
``/unload_lora_adapter``, ``GET /v1/models``, and the adapter names ``/generate`` takes in ``lora_path``.

Shapes (SGLang's ``LoadLoRAAdapterReqInput`` / ``UnloadLoRAAdapterReqInput`` / ``LoRAUpdateOutput``):
- ``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"?}`` and ``POST /unload_lora_adapter
  {"lora_name"}`` answer ``{"rid": null, "http_worker_ipc": null, "success", "error_message",
  "loaded_adapters": {name: path}}``, 200 on success, 400 otherwise (403 for a directory outside the
  allowed ones, with a message that names no path).
- ``GET /v1/models``: the base model card, then one card per adapter (``id`` its name, ``root`` its
  path, ``parent`` the base model), as SGLang lists them.
- ``/generate``'s ``lora_path``: an adapter name for every prompt, or a list with one name (or null)
  per prompt; a name not loaded is a 400 naming it.

Guarantees: an adapter is registered only after ``lora.read_adapter`` checked all of it (nothing
half-loaded); a duplicate name, one being loaded at the same moment, or more than ``max_loaded``
adapters is a 400 that changes nothing; unloading removes the name at once for new requests, while
sequences already running with that adapter finish with it (SGLang waits for them before its
unload answers; here they keep their reference, which gives the same tokens).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from headrace.rollout.engine.http import json_body, json_response
from headrace.rollout.engine.lora import AdapterError, LoraAdapter, read_adapter

__all__ = ["LoraRegistry", "add_lora_routes"]

MAX_NAME = 256
LOAD_FIELDS = {"lora_name", "lora_path", "pinned", "lora_id"}
UNLOAD_FIELDS = {"lora_name", "lora_id"}


class LoraRegistry:
    """The adapters loaded on one engine, by name (touched only from the event loop)."""

    def __init__(self, engine: Any, max_loaded: int = 16) -> None:
        self.engine = engine
        self.base_names = [engine.model_path]
        self.max_loaded = max_loaded
        self.adapters: dict[str, LoraAdapter] = {}
        self.pending: set[str] = set()

    def loaded(self) -> dict[str, str]:
        return {n: a.path for n, a in self.adapters.items()}

    def resolve(self, value: Any, n_items: int, batch: bool) -> list[LoraAdapter | None]:
        """The adapter of each prompt from ``/generate``'s ``lora_path``; ValueError naming the problem."""
        if value is None:
            return [None] * n_items
        names = value if isinstance(value, list) else [value] * n_items
        if isinstance(value, list) and len(value) != n_items:
            raise ValueError(f"lora_path is a list of {len(value)} but there are {n_items} prompts")
        out: list[LoraAdapter | None] = []
        for i, n in enumerate(names):
            where = f"lora_path[{i}]" if isinstance(value, list) else "lora_path"
            if n is None:
                out.append(None)
                continue
            if not isinstance(n, str) or not n:
                raise ValueError(f"{where} must be a loaded adapter's name (a non-empty string) or null")
            ad = self.adapters.get(n)
            if ad is None:
                raise ValueError(f"The following requested LoRA adapters are not loaded: {n}\n"
                                 f"Loaded adapters: {sorted(self.adapters)}.")
            out.append(ad)
        return out

    def _answer(self, ok: bool, message: str = "", status: int | None = None) -> Response:
        return json_response({"rid": None, "http_worker_ipc": None, "success": ok, "error_message": message,
                              "loaded_adapters": self.loaded()}, status or (200 if ok else 400))

    @staticmethod
    def _name(body: Any, fields: set[str]) -> str:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        extra = sorted(set(body) - fields)
        if extra:
            raise ValueError(f"unknown fields {extra} (known: {', '.join(sorted(fields))})")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable():
            raise ValueError(f"lora_name must be a non-empty printable string of at most {MAX_NAME} characters")
        lid = body.get("lora_id")
        if lid is not None and not isinstance(lid, str):
            raise ValueError("lora_id must be a string or null")
        return name

    async def load(self, body: Any) -> Response:
        try:
            name = self._name(body, LOAD_FIELDS)
            path = body.get("lora_path")
            if not isinstance(path, str) or not path:
                raise ValueError("lora_path must be a non-empty string (the adapter's directory)")
            if not isinstance(body.get("pinned", False), bool):
                raise ValueError("pinned must be a boolean")
        except ValueError as e:
            return self._answer(False, f"load_lora_adapter: {e}")
        if name in self.adapters or name in self.pending:
            return self._answer(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        if len(self.adapters) + len(self.pending) >= self.max_loaded:
            return self._answer(False, f"Failed to load LoRA adapter {name}: {self.max_loaded} adapters are loaded, "
                                       "the most this engine holds; unload one first")
        self.pending.add(name)
        try:
            names = [*self.base_names, self.engine.model_path]
            ad = await asyncio.to_thread(read_adapter, name, path, self.engine.model, names,
                                         self.engine.updates.weight_dirs)
        except AdapterError as e:
            return self._answer(False, f"Failed to load LoRA adapter {name}: {e}" if e.status != 403 else str(e),
                                e.status)
        finally:
            self.pending.discard(name)
        self.adapters[name] = ad
        return self._answer(True)

    async def unload(self, body: Any) -> Response:
        try:
            name = self._name(body, UNLOAD_FIELDS)
        except ValueError as e:
            return self._answer(False, f"unload_lora_adapter: {e}")
        if name not in self.adapters:
            return self._answer(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}")
        del self.adapters[name]
        return self._answer(True)

    def models(self) -> dict[str, Any]:
        import time

        now = int(time.time())
        base = self.engine.model_path
        cards = [{"id": base, "object": "model", "created": now, "owned_by": "sglang", "root": base,
                  "parent": None, "max_model_len": self.engine.context_length}]
        cards += [{"id": n, "object": "model", "created": now, "owned_by": "sglang", "root": a.path,
                   "parent": base, "max_model_len": None} for n, a in self.adapters.items()]
        return {"object": "list", "data": cards}


def add_lora_routes(app: FastAPI, registry: LoraRegistry) -> None:
    """Mount ``/load_lora_adapter``, ``/unload_lora_adapter`` (POST) and ``/v1/models`` (GET)."""

    async def body_of(request: Request) -> Any:
        try:
            return await json_body(request)
        except ValueError as e:
            return e

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        return registry._answer(False, f"load_lora_adapter: {body}") if isinstance(body, ValueError) \
            else await registry.load(body)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        return registry._answer(False, f"unload_lora_adapter: {body}") if isinstance(body, ValueError) \
            else await registry.unload(body)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(registry.models())
