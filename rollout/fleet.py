"""The engine fleet: launch or attach, health-check, restart, and talk to every engine over HTTP.

Backends (``rollout.engines.backend``):
- ``reference``: ``headrace engine serve --model M --port P`` child processes (OMP_NUM_THREADS from
  ``engines.threads``, default 1, and OMP_WAIT_POLICY=PASSIVE: spinning OpenMP threads of several
  processes on a few cores slow each other down 30x);
- ``sglang``: ``<engines.python> -m sglang.launch_server --model-path M --port P --tp-size T <args>``;
- ``vllm``: one ``rollout.vllm_backend`` adapter per engine (SGLang's API on the engine's port), which
  launches ``<engines.python> -m vllm.entrypoints.openai.api_server ... <args>`` on a private port, or
  attaches to ``engines.urls[i]``; it exits with one line naming the fix when vLLM is unusable;
- ``external``: the URLs in ``engines.urls``, started elsewhere (never restarted by us).

Guarantees:
- Engines are reached only over SGLang's HTTP API; this module never imports ``rollout.engine``.
- ``start`` returns once every engine answers /health, or raises naming the engine and its log.
  An external engine that is up (``/get_model_info`` answers) but whose /health has answered 503
  for ``HELD_AFTER_S`` is taken as *held*: paused by a predecessor of this service (killed between
  a trainer's pause and its resume). ``held`` lists them; the service then starts paused, and the
  trainer's retried ``/v1/resume`` releases them. Never resumed here: a weight sync may be running.
- A launched engine whose process exits, or that fails ``health_failures`` checks in a row, is
  marked unhealthy at once (requests on it fail and are rerouted by the caller), killed and
  relaunched on the same port (up to ``max_restarts``).
- While generation is paused or engine memory is released (``quiet``, set by the service), the
  probe is ``/get_model_info`` instead of ``/health``: SGLang's /health runs a generation, so it
  blocks and answers 503 while paused; a paused engine is alive, not down.
- A restarted engine loads weights from the model directory. If the fleet already moved past
  weight version 0 it is held out of routing (``stale``) until the next ``/v1/resume`` — after
  the trainer has synced weights to every engine listed by /v1/engines — so no token is ever
  tagged with a version its engine does not hold.
- ``stop`` ends only the processes this fleet started, by process group id.
- Launched engines die with this process, even when it is killed with SIGKILL: a reference engine
  gets ``--parent-pid`` (its watchdog stops it once this process is gone); an SGLang engine gets
  ``PR_SET_PDEATHSIG`` = SIGTERM (Linux) in ``preexec_fn``. The death signal follows the *thread*
  that forked: engines are launched from the main thread (``launch``, or the event loop), which
  lives as long as the service. A configured port still held (by engines of a killed predecessor,
  which are stopping) is waited for up to ``PORT_WAIT_S`` before another port is taken.
- ``launch`` starts the engine processes without waiting for them, so the rollout service calls it
  before loading its data and tokenizer, which then overlap the engines' own start; ``start``
  launches them if that was not done, then waits until they are healthy.
- Launched engines bind ``engines.host`` (127.0.0.1) and are listed (``/v1/engines``, the URLs the
  trainer dials for weight sync) as ``http://<engines.advertise_host or host>:<port>``; bound to
  0.0.0.0 / :: without an advertise host, they are listed under this machine's host name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from headrace.rollout.vllm_launch import adapter_command
from headrace.shared.aio import AioHTTP
from headrace.shared.auth import TOKEN_ENV, bearer_headers, bind_refusal, module_argv, token_env
from headrace.shared.config import EnginesConfig
from headrace.shared.procs import child_env, free_port, stop_group

log = logging.getLogger("headrace.rollout.fleet")
PORT_WAIT_S = 15.0   # engines of a killed service stop within ~10 s (watchdog + shutdown deadline)
HELD_AFTER_S = 20.0  # /health 503 while /get_model_info answers, this long: the engine is paused, not starting


def _port_freed(port: int, host: str, wait_s: float = PORT_WAIT_S) -> bool:
    """Whether ``port`` can be listened on, waiting up to ``wait_s`` while it is held. SO_REUSEADDR
    as uvicorn binds: connections in TIME_WAIT do not hold it."""
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return True
            except OSError:
                pass
        if time.monotonic() >= deadline:
            log.warning("port %d is still in use after %.0f s; taking another", port, wait_s)
            return False
        time.sleep(0.25)   # only before any engine runs (launch): nothing else waits on this thread


def die_with_parent() -> Any:
    """A preexec_fn: the child gets SIGTERM when the launching thread ends (Linux; else None)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl    # resolved before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM))                     # PR_SET_PDEATHSIG
        if os.getppid() != parent:                        # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclass
class Engine:
    """One inference server as the fleet sees it."""

    index: int
    url: str
    world_size: int = 1
    port: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    healthy: bool = False
    stale: bool = False
    in_flight: int = 0
    restarts: int = 0
    failures: int = 0
    served: int = 0
    restarting: bool = field(default=False, repr=False)

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "stale": self.stale, "in_flight": self.in_flight,
                "restarts": self.restarts, "served": self.served,
                "pid": self.proc.pid if self.proc else None}


def advertised_host(bind: str, advertise: str | None) -> str:
    """The host name others use to reach a server bound to ``bind`` (URL form: IPv6 in brackets)."""
    host = advertise or (socket.gethostname() if bind in ("0.0.0.0", "::", "") else bind)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Fleet:
    """Engines plus their health monitor. ``version`` is the weight version engines hold."""

    def __init__(self, cfg: EnginesConfig, model: str, log_dir: Path, token: str | None = None) -> None:
        self.cfg = cfg
        self.token = token  # the run token: engines are launched with it (environment only), every call sends it
        self.model = model
        self.log_dir = log_dir
        self.engines: list[Engine] = []
        self.version = 0
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # httpcore scans its whole pool for every request: a pool full of idle (or server-closed)
        # keep-alive connections made each batch slower than the last. Keep few, briefly.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=5.0), headers=bearer_headers(token),
                                      limits=httpx.Limits(max_connections=4096, max_keepalive_connections=16,
                                                          keepalive_expiry=2.0))
        # the periodic probes and per-batch version reads: aiohttp costs a third of httpx's CPU per request
        self.wire = AioHTTP(bearer_headers(token))
        self._closing = False
        self.on_replaced: Any = None  # async callback(engine) after a restart, set by the router
        self.quiet: set[str] = set()  # why generation is held ("paused", "memory released"): liveness probes only
        self.held: list[Engine] = []  # external engines found paused at start (see ``start``)
        self.adapter: str | None = None        # the LoRA adapter generation names (rollout.adapters), or None
        self.adapter_root: Path | None = None  # reference engines may load adapters from here (lora_sync: adapter)

    # ---- launching ----

    def _command(self, port: int) -> list[str]:
        b = self.cfg.backend
        if b == "reference":
            cmd = [sys.executable, "-m", "headrace.deploy.cli", "engine", "serve", "--model", self.model,
                   "--host", self.cfg.host, "--port", str(port), "--threads", str(self.cfg.threads or 1),
                   "--parent-pid", str(os.getpid())]
            if self.adapter_root is not None:
                cmd += ["--allowed-weight-dirs", str(self.adapter_root)]
            if bind_refusal(self.cfg.host, self.token, False):   # `headrace rollout serve --insecure` allowed it
                cmd.append("--insecure")
        elif b == "sglang":
            if not self.cfg.python:
                raise ValueError("rollout.engines.python: backend sglang needs the python of the SGLang venv")
            args = ["--model-path", self.model, "--host", self.cfg.host, "--port", str(port)]
            if self.cfg.tp > 1:
                args += ["--tp-size", str(self.cfg.tp)]
            cmd = module_argv(self.cfg.python, "sglang.launch_server", args, self.token)  # --api-key from env
        elif b == "vllm":   # an SGLang-API adapter (rollout/vllm_backend.py) that launches or attaches to vLLM
            index = next(e.index for e in self.engines if e.port == port)
            if not self.cfg.urls and not self.cfg.python:
                raise ValueError("rollout.engines.python: backend vllm needs the python of the vLLM venv "
                                 "(`make vllm-venv` builds .venv-vllm/bin/python), or vLLM urls to attach to")
            return adapter_command(self.model, self.cfg.host, port, self.cfg.startup_timeout_s, python=self.cfg.python,
                                   upstream=self.cfg.urls[index] if self.cfg.urls else None, args=self.cfg.args,
                                   parent_pid=os.getpid())
        else:
            raise AssertionError(b)
        return cmd + list(self.cfg.args)

    def _env(self) -> dict[str, str]:
        env = child_env(self.cfg.threads or 1)
        if self.cfg.backend != "reference":   # SGLang sizes its own thread pools: keep what we were given
            for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env.pop(k)
                if k in os.environ:
                    env[k] = os.environ[k]
        env.update(self.cfg.env)
        env.pop(TOKEN_ENV, None)
        env.update(token_env(self.token))
        return env

    def _launch(self, e: Engine) -> None:
        assert e.port is not None
        cmd = self._command(e.port)
        e.log_path = self.log_dir / f"engine-{e.index}.log"
        e.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(e.log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
            e.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self._env(),
                                      start_new_session=True,
                                      preexec_fn=None if self.cfg.backend == "reference" else die_with_parent())
        log.info("engine %d: pid %d on %s", e.index, e.proc.pid, e.url)

    async def _wait_healthy(self, e: Engine, timeout: float, held_after_s: float | None = None) -> None:
        """Until ``e`` answers /health; with ``held_after_s`` (external engines at start), also until
        it has been up but not generating that long (then it is added to ``held``)."""
        deadline = time.monotonic() + timeout
        held_since: float | None = None
        while time.monotonic() < deadline:
            if e.proc is not None and e.proc.poll() is not None:
                tail = e.log_path.read_text(errors="replace")[-2000:] if e.log_path else ""
                raise RuntimeError(f"engine {e.index} ({e.url}) exited with {e.proc.returncode} "
                                   f"before it was healthy; log {e.log_path}:\n{tail}")
            if await self._probe(e):
                return
            if held_after_s is not None:
                if await self._up_not_generating(e):
                    held_since = held_since or time.monotonic()
                    if time.monotonic() - held_since >= held_after_s:
                        log.warning("engine %d (%s) is up but has not generated for %.0f s (/health 503): "
                                    "taken as paused by a previous rollout service; this service starts "
                                    "paused until POST /v1/resume", e.index, e.url, held_after_s)
                        self.held.append(e)
                        return
                else:
                    held_since = None
            await asyncio.sleep(0.25)
        raise RuntimeError(f"engine {e.index} ({e.url}) not healthy after {timeout:.0f} s "
                           f"(rollout.engines.startup_timeout_s); log {e.log_path}")

    async def _probe(self, e: Engine) -> bool:
        path = "/get_model_info" if self.quiet else "/health"
        try:
            r = await self.wire.request("GET", f"{e.url}{path}", timeout_s=5.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def _up_not_generating(self, e: Engine) -> bool:
        """/health answers 503 (the server is up) and /get_model_info answers 200."""
        try:
            if (await self.wire.request("GET", f"{e.url}/health", timeout_s=5.0)).status_code != 503:
                return False
            return (await self.wire.request("GET", f"{e.url}/get_model_info", timeout_s=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def launch(self) -> None:
        """Pick the ports and start every engine process this fleet launches, without waiting for
        them (a no-op for external engines, or once done). Call from the main thread."""
        if self.cfg.backend == "external" or self.engines:
            return
        taken: set[int] = set()
        host = advertised_host(self.cfg.host, self.cfg.advertise_host)
        count = len(self.cfg.urls) if self.cfg.backend == "vllm" and self.cfg.urls else self.cfg.count
        for i in range(count):
            port = self.cfg.base_port + i
            if port in taken or not _port_freed(port, self.cfg.host):
                port = free_port()
            taken.add(port)
            self.engines.append(Engine(index=i, url=f"http://{host}:{port}", port=port, world_size=self.cfg.tp))
        try:
            for e in self.engines:
                self._launch(e)
        except BaseException:
            self.kill_launched()
            raise

    def kill_launched(self) -> None:
        """End the engine processes ``launch`` started (a service that fails before it serves)."""
        for e in self.engines:
            if e.proc is not None:
                stop_group(e.proc)

    async def start(self) -> None:
        """Launch or attach every engine and wait until all are healthy (or held); then watch them."""
        if self.cfg.backend == "external":
            if not self.cfg.urls:
                raise ValueError("rollout.engines.urls: backend external needs at least one URL")
            self.engines = [Engine(index=i, url=u.rstrip("/"), world_size=self.cfg.tp)
                            for i, u in enumerate(self.cfg.urls)]
        else:
            self.launch()
        try:
            held_after = HELD_AFTER_S if self.cfg.backend == "external" else None
            await asyncio.gather(*(self._wait_healthy(e, self.cfg.startup_timeout_s, held_after) for e in self.engines))
        except BaseException:
            await self.stop()
            raise
        for e in self.engines:
            e.healthy = True
        await self._fetch_world_sizes()
        self._monitor = asyncio.create_task(self._watch())
        self._notify()

    async def _fetch_world_sizes(self) -> None:
        for e in self.engines:
            try:
                r = await self.http.get(f"{e.url}/get_server_info", timeout=5.0)
                if r.status_code == 200:
                    info = r.json()
                    tp = int(info.get("tp_size") or info.get("tp") or e.world_size)
                    e.world_size = tp * int(info.get("pp_size") or 1)
            except (httpx.HTTPError, ValueError, TypeError):
                pass

    # ---- routing state ----

    def routable(self) -> list[Engine]:
        return [e for e in self.engines if e.healthy and not e.stale]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed_wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def mark_down(self, e: Engine, why: str) -> None:
        """Take an engine out of routing now (called on a connection failure or a failed check)."""
        if e.healthy:
            log.warning("engine %d (%s) down: %s", e.index, e.url, why)
        e.healthy = False
        self._notify()

    def set_version(self, version: int) -> None:
        """Weights of ``version`` are on every healthy engine (after a sync): route to all of them."""
        self.version = version
        for e in self.engines:
            if e.healthy:
                e.stale = False
        self._notify()

    # ---- health ----

    async def _watch(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.cfg.health_interval_s)
            await asyncio.gather(*(self._check(e) for e in self.engines if not e.restarting))

    async def _check(self, e: Engine) -> None:
        dead = e.proc is not None and e.proc.poll() is not None
        if not dead:
            if await self._probe(e):
                e.failures = 0
                if not e.healthy and e.proc is None:  # an external engine came back
                    log.info("engine %d (%s) healthy again", e.index, e.url)
                    e.healthy = True
                    e.stale = self.version > 0
                    self._notify()
                return
            e.failures += 1
            if e.failures < self.cfg.health_failures:
                return
        self.mark_down(e, "process exited" if dead else f"{e.failures} failed health checks")
        if e.proc is not None and self.cfg.restart and not self._closing:
            if e.restarts >= self.cfg.max_restarts:
                if e.restarts == self.cfg.max_restarts:
                    log.error("engine %d: %d restarts used up; leaving it down", e.index, e.restarts)
                    e.restarts += 1
                return
            e.restarting = True
            t = asyncio.create_task(self._restart(e))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _restart(self, e: Engine) -> None:
        try:
            if e.proc is not None:
                await asyncio.to_thread(stop_group, e.proc, 5.0)
            e.restarts += 1
            log.warning("engine %d: restart %d", e.index, e.restarts)
            self._launch(e)
            await self._wait_healthy(e, self.cfg.startup_timeout_s)
            e.failures = 0
            e.stale = self.version > 0
            if self.on_replaced is not None:   # registered (sglang-router) before it counts as healthy
                await self.on_replaced(e)
            e.healthy = True
            log.info("engine %d back on %s%s", e.index, e.url, " (stale weights: held out)" if e.stale else "")
            self._notify()
        except Exception as ex:  # noqa: BLE001 - logged; the monitor tries again
            log.error("engine %d restart failed: %s", e.index, ex)
        finally:
            e.restarting = False

    # ---- broadcast ----

    async def broadcast(self, path: str, body: dict[str, Any] | None = None, *, timeout: float = 60.0,
                        healthy_only: bool = True) -> dict[str, Any]:
        """POST ``body`` to ``path`` on every (healthy) engine; {url: answer or error string}."""
        targets = [e for e in self.engines if e.healthy or not healthy_only]

        async def one(e: Engine) -> Any:
            try:
                r = await self.http.post(f"{e.url}{path}", json=body or {}, timeout=timeout)
                try:
                    return {"status": r.status_code, "body": r.json()}
                except ValueError:
                    return {"status": r.status_code, "body": r.text[:500]}
            except httpx.HTTPError as ex:
                return {"status": None, "error": f"{type(ex).__name__}: {ex}"}

        results = await asyncio.gather(*(one(e) for e in targets))
        return {e.url: res for e, res in zip(targets, results)}

    async def stop(self) -> None:
        """Stop watching and end the engine processes this fleet launched."""
        self._closing = True
        if self._monitor:
            self._monitor.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(asyncio.to_thread(stop_group, e.proc) for e in self.engines if e.proc))
        await self.http.aclose()
        await self.wire.close()
