"""Request routing over the engine fleet: built-in least-in-flight, or an sglang-router process.

Guarantees:
- ``LeastInFlight.pick`` returns a healthy, routable engine with the fewest requests in flight
  (ties broken round-robin), and waits (never fails) while no engine is routable.
- ``SGLangRouter`` runs ``python -m sglang_router.launch_router`` (sglang-router 0.3.x, from the
  SGLang venv) as a child process and manages its workers over HTTP: ``POST /workers {"url"}``,
  ``GET /workers``, ``DELETE /workers/{id}``. Requests then go to the router's URL; health,
  restart and pause/abort still talk to every engine directly. The router's own health checks use
  ``/get_model_info`` (liveness) unless ``router_args`` name ``--health-check-endpoint``: SGLang's
  /health fails while generation is paused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote

import httpx

from headrace.shared.auth import bearer_headers, module_argv, token_env

if TYPE_CHECKING:
    from headrace.rollout.fleet import Engine, Fleet

log = logging.getLogger("headrace.rollout.router")


class Router(Protocol):
    async def start(self) -> None: ...
    async def pick(self) -> "Engine": ...
    async def engine_replaced(self, engine: "Engine") -> None: ...
    async def stop(self) -> None: ...


class LeastInFlight:
    """Client-side router: the healthy engine with the fewest requests in flight."""

    def __init__(self, fleet: "Fleet") -> None:
        self.fleet = fleet
        self._rr = itertools.count()

    async def start(self) -> None:
        return None

    async def pick(self) -> "Engine":
        waited = 0.0
        while True:
            ready = self.fleet.routable()
            if ready:
                low = min(e.in_flight for e in ready)
                best = [e for e in ready if e.in_flight == low]
                return best[next(self._rr) % len(best)]
            if waited >= 30.0 and int(waited) % 30 == 0:
                log.warning("no healthy engine for %.0f s; waiting", waited)
            await self.fleet.changed_wait(0.5)
            waited += 0.5

    async def engine_replaced(self, engine: "Engine") -> None:
        return None

    async def stop(self) -> None:
        return None


class SGLangRouter:
    """An sglang-router process in front of the engines; workers managed with POST/DELETE /workers."""

    def __init__(self, fleet: "Fleet", python: str | None, port: int, log_dir: Path,
                 args: list[str] | None = None) -> None:
        from headrace.rollout.fleet import Engine

        self.fleet = fleet
        self.python = python or sys.executable
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.args = list(args or [])
        self.log_path = log_dir / "sglang-router.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # The router looks like one engine to the generation code; its in_flight counts all requests.
        self.engine = Engine(index=-1, url=self.url, world_size=0)
        self.engine.healthy = True

    async def start(self) -> None:
        from headrace.shared.procs import free_port

        # its Prometheus exporter binds a fixed port (29000) by default: give it a free one. Its own
        # health checks probe liveness only (SGLang's /health blocks and fails while generation is
        # paused: a long training phase would get every worker marked unhealthy); the fleet watches
        # /health itself, restarts a dead engine and registers the new one again.
        health = [] if any(a.startswith("--health-check-endpoint") for a in self.args) else \
            ["--health-check-endpoint", "/get_model_info"]
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), *health, *self.args]
        from headrace.rollout.fleet import die_with_parent

        cmd = module_argv(self.python, "sglang_router.launch_router", args, self.fleet.token)  # --api-key from env
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **token_env(self.fleet.token)},
                                         preexec_fn=die_with_parent())   # dies with this service, like its engines
        log.info("sglang-router pid %d on %s: %s", self.proc.pid, self.url, " ".join(cmd))
        async with httpx.AsyncClient(timeout=5.0, headers=bearer_headers(self.fleet.token)) as c:
            for _ in range(600):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sglang-router exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    if (await c.get(f"{self.url}/health")).status_code < 500:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
            else:
                raise RuntimeError(f"sglang-router not up on {self.url} after 120 s; see {self.log_path}")
            for e in self.fleet.engines:
                if e.healthy:
                    await self._add(c, e.url)

    async def _add(self, c: httpx.AsyncClient, url: str) -> None:
        r = await c.post(f"{self.url}/workers", json={"url": url})
        if r.status_code >= 400:
            raise RuntimeError(f"sglang-router POST /workers {url}: {r.status_code} {r.text[:300]}")

    async def _remove(self, c: httpx.AsyncClient, url: str) -> None:
        r = await c.get(f"{self.url}/workers")
        if r.status_code >= 400:
            return
        body = r.json()
        workers = body.get("workers", body) if isinstance(body, dict) else body
        for w in workers or []:
            if isinstance(w, dict) and w.get("url") == url:
                wid = w.get("id") or w.get("worker_id") or url
                await c.delete(f"{self.url}/workers/{quote(str(wid), safe='')}")

    async def pick(self) -> "Engine":
        while not self.fleet.routable():
            await self.fleet.changed_wait(0.5)
        return self.engine

    async def engine_replaced(self, engine: "Engine") -> None:
        """A restarted engine: drop its stale registration and register it again."""
        async with httpx.AsyncClient(timeout=10.0, headers=bearer_headers(self.fleet.token)) as c:
            try:
                await self._remove(c, engine.url)
                await self._add(c, engine.url)
            except (httpx.HTTPError, RuntimeError) as e:
                log.warning("sglang-router: re-registering %s failed: %s", engine.url, e)

    async def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            from headrace.shared.procs import stop_group

            await asyncio.to_thread(stop_group, self.proc)
