"""HTTP client for the rollout service's control API (used by the trainer's loop and by tools).

Every call has a timeout and raises ``RolloutError`` naming the endpoint and the service's
message on failure; calls that are safe to repeat (status, engines, pause, resume) are retried on
connection errors, so a rollout service restart in the middle of a run is ridden out. With the run
token (``auth.token``) every call carries ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from headrace.shared.auth import bearer_headers
from headrace.shared.weight_sync.protocol import EngineTarget


class RolloutError(RuntimeError):
    """The rollout service answered an error or could not be reached."""


class RolloutClient:
    def __init__(self, url: str, timeout: float = 600.0, retries: int = 30, backoff_s: float = 0.5,
                 token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=bearer_headers(token))

    def _call(self, method: str, path: str, body: Any = None, *, retry: bool = True, timeout: float | None = None) -> Any:
        attempts = self.retries if retry else 1
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                resp = self._http.request(method, path, json=body, timeout=timeout or httpx.USE_CLIENT_DEFAULT)
            except httpx.TransportError as e:
                last = e
                time.sleep(min(5.0, self.backoff_s * (2 ** attempt)))
                continue
            if resp.status_code >= 400:
                raise RolloutError(f"{method} {self.url}{path}: {resp.status_code} {resp.text[:500]}")
            return resp.json() if resp.content else None
        raise RolloutError(f"{method} {self.url}{path}: unreachable after {attempts} attempts ({last})")

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    def engines(self) -> list[EngineTarget]:
        return [EngineTarget(url=e["url"], world_size=int(e.get("world_size", 1))) for e in self._call("GET", "/v1/engines")]

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        return self._call("POST", "/v1/pause", {"mode": mode})

    def resume(self, weight_version: int) -> dict[str, Any]:
        return self._call("POST", "/v1/resume", {"weight_version": weight_version})

    def load_adapter(self, path: str, weight_version: int) -> dict[str, Any]:
        """``trainer.lora_sync: adapter``: every engine loads the PEFT directory ``path`` as
        ``v<weight_version>`` (repeatable: engines that have it are skipped); 502 names failing engines."""
        return self._call("POST", "/v1/load_adapter", {"path": path, "weight_version": weight_version})

    def generate_batch(self, groups: int, weight_version: int | None = None) -> dict[str, Any]:
        """On-demand: ``groups`` new groups into the buffer. ``weight_version`` names the weights the
        engines serve (the caller synced them); without it the service asks every engine."""
        body: dict[str, Any] = {"groups": groups}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._call("POST", "/v1/generate_batch", body, retry=False)

    def release_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/release_memory", {"tags": tags or ["weights", "kv_cache"]})

    def resume_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/resume_memory", {"tags": tags or ["weights", "kv_cache"]})

    def evaluate(self, n: int | None = None, part: tuple[int, int] | None = None) -> dict[str, Any]:
        """Score the current policy on the held-out prompts: ``{"score", "reward_mean", "n", ...}``;
        ``part`` (i, k): on prompts i, i + k, ... of them only."""
        return self._call("POST", "/v1/evaluate", {"n": n, **({"part": list(part)} if part else {})}, retry=False)

    def close(self) -> None:
        self._http.close()
