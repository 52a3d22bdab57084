"""The fleet's side of the adapter weight sync (``trainer.lora_sync: adapter``, DESIGN.md "LoRA").

``AdapterSync.load(path, v)`` (``POST /v1/load_adapter``) loads the PEFT directory on every healthy
engine as ``v<v>`` through SGLang's ``/load_lora_adapter`` and sets each engine's weight version
to v; at ``/v1/resume {"weight_version": v}``, ``switch(v)`` makes generation name ``v<v>`` and,
once generation continues, ``unload_old()`` unloads every older ``v<n>`` adapter from the engines.

Guarantees:
- All or nothing: when any engine fails to load (or to confirm version v), the adapter is unloaded
  again from the engines that loaded it in this call and ``AdapterError`` names each failing engine
  and its answer; generation keeps naming the previous adapter, so no token comes from a mix.
- Repeating a load is harmless: an engine that already lists ``v<v>`` (``GET /v1/models``) is not
  asked again (an engine restarted meanwhile has lost its adapters and loads it).
- Generation names ``v<v>`` only after ``load`` succeeded for v, and the previous adapter is unloaded
  only after that switch, while generation is paused (``/v1/resume`` runs it), so no request uses it.
- Only names of the form ``v<digits>`` are ever unloaded: adapters loaded by others stay.
- A restarted rollout service finds the adapter of the engines' version (``adopt``) and names it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any

import httpx

from headrace.shared.weight_sync.adapter import adapter_name

if TYPE_CHECKING:
    from headrace.rollout.fleet import Engine, Fleet

log = logging.getLogger("headrace.rollout.adapters")
OURS = re.compile(r"^v\d+$")


class AdapterError(RuntimeError):
    """A load that failed on some engines; ``engines`` maps each one's URL to what it answered."""

    def __init__(self, message: str, engines: dict[str, str]) -> None:
        super().__init__(message)
        self.engines = engines


class AdapterSync:
    def __init__(self, fleet: "Fleet", timeout_s: float = 300.0) -> None:
        self.fleet = fleet
        self.timeout_s = timeout_s
        self.loaded_version: int | None = None   # the last version ``load`` put on every engine

    async def _post(self, e: "Engine", path: str, body: dict[str, Any]) -> str | None:
        """None on 200, else what went wrong."""
        try:
            r = await self.fleet.http.post(f"{e.url}{path}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as ex:
            return f"{path}: {type(ex).__name__}: {ex}"
        if r.status_code != 200:
            try:
                b = r.json()
                msg = b.get("error_message") or b.get("message") or (b.get("error") or {}).get("message") or b
            except (ValueError, AttributeError):
                msg = r.text[:500]
            return f"{path}: {r.status_code} {msg}"
        return None

    async def listed(self, e: "Engine") -> set[str]:
        """The adapters ``e`` lists on ``GET /v1/models`` (cards with a parent)."""
        r = await self.fleet.http.get(f"{e.url}/v1/models", timeout=30.0)
        r.raise_for_status()
        return {c["id"] for c in r.json().get("data", []) if c.get("parent")}

    async def load(self, path: str, version: int) -> dict[str, Any]:
        name = adapter_name(version)
        targets = [e for e in self.fleet.engines if e.healthy]
        if not targets:
            raise AdapterError(f"no healthy engine to load adapter {name} on", {})
        async def one(e: "Engine") -> tuple[str | None, bool]:
            """(error, whether this call loaded it)."""
            try:
                if name in await self.listed(e):
                    return None, False
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as ex:
                return f"/v1/models: {type(ex).__name__}: {ex}", False
            err = await self._post(e, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
            return err, err is None

        results = await asyncio.gather(*(one(e) for e in targets))
        fresh = [e for e, (_, new) in zip(targets, results) if new]
        errors = {e.url: err for e, (err, _) in zip(targets, results) if err}
        if not errors:
            res = await asyncio.gather(*(self._set_version(e, version) for e in targets))
            errors = {e.url: err for e, err in zip(targets, res) if err}
        if errors:
            undo = await asyncio.gather(*(self._post(e, "/unload_lora_adapter", {"lora_name": name}) for e in fresh))
            for e, err in zip(fresh, undo):
                if err:
                    log.warning("engine %s: unloading the failed adapter %s again failed: %s", e.url, name, err)
            detail = "; ".join(f"{u}: {m}" for u, m in errors.items())
            raise AdapterError(f"adapter {name} ({path}) failed on {len(errors)} of {len(targets)} engine(s): "
                               f"{detail}", errors)
        self.loaded_version = version
        return {"name": name, "engines": len(targets), "loaded": [e.url for e in fresh]}

    async def _set_version(self, e: "Engine", version: int) -> str | None:
        err = await self._post(e, "/update_weight_version", {"new_version": str(version)})
        if err:
            return err
        try:
            got = (await self.fleet.http.get(f"{e.url}/get_weight_version", timeout=30.0)).json()["weight_version"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as ex:
            return f"/get_weight_version: {type(ex).__name__}: {ex}"
        return None if got == str(version) else f"weight version is {got!r} after setting {version}"

    def switch(self, version: int) -> bool:
        """Generation names ``v<version>`` from now on, when ``load`` put it on the engines (called while
        generation is held, before it continues); whether it switched."""
        if self.loaded_version != version:
            return False
        self.fleet.adapter = adapter_name(version)
        return True

    async def unload_old(self) -> dict[str, str]:
        """Unload every ``v<n>`` adapter but the current one; {engine URL: error} for those that failed
        (logged; tried again after the next switch)."""
        current = self.fleet.adapter
        errors: dict[str, str] = {}

        async def tidy(e: "Engine") -> None:
            try:
                old = [n for n in await self.listed(e) if OURS.match(n) and n != current]
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as ex:
                errors[e.url] = f"/v1/models: {ex}"
                return
            for n in old:
                err = await self._post(e, "/unload_lora_adapter", {"lora_name": n})
                if err:
                    errors[e.url] = err

        await asyncio.gather(*(tidy(e) for e in self.fleet.engines if e.healthy))
        for url, err in errors.items():
            log.warning("engine %s: unloading an old adapter failed: %s", url, err)
        return errors

    async def adopt(self, version: int) -> None:
        """At start: name ``v<version>`` when every routable engine lists it (a restarted service)."""
        name = adapter_name(version)
        engines = self.fleet.routable()
        try:
            lists = [await self.listed(e) for e in engines]
            if engines and all(name in names for names in lists):
                self.fleet.adapter, self.loaded_version = name, version
                log.info("engines serve adapter %s: generation names it", name)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as ex:
            log.info("could not list the engines' adapters (%s): generation names none until the next sync", ex)
