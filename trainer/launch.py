"""Run a function in N fresh processes that form one torch.distributed job (like torchrun).

``spawn(fn, n, *args)`` starts n processes with the "spawn" start method (no fork of a parent that
may hold torch thread pools or sockets), sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT (a port free on loopback) and the thread limits before torch is imported in the child,
calls ``fn(*args)`` and returns each rank's return value in rank order.

A SIGTERM to the calling process (when ``spawn`` runs in the main thread) is passed on to every
rank that is still running and ``spawn`` keeps collecting results, so ranks that stop gracefully on
SIGTERM (``trainer.loop``) can finish their checkpoint.

Guarantees: if any rank raises, ``spawn`` raises ``RuntimeError`` carrying that rank's traceback
and ends the other ranks it started (by their process handles); a rank that dies without a result
(killed, segfault) or a job that runs past ``timeout_s`` is an error too. Nothing is left running.
``fn`` and ``args`` must be picklable (module-level functions, or ``Lazy("module", "name")``: a
function named by its module, imported in the ranks only, so a launcher that never runs the
function itself need not import what it imports). Importing this module does not import torch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from headrace.shared.procs import child_env, free_port


@dataclass(frozen=True)
class Lazy:
    """``module.name``, imported when called: ``headrace train`` hands its ranks the training
    function this way, so the launching process never imports torch or megatron (~2.4 s of CPU
    at every start, spent while the other services start on the same cores)."""

    module: str
    name: str

    def __str__(self) -> str:   # how failure reports name the function
        return f"{self.module}.{self.name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


def _name(fn: Any) -> str:
    return str(fn) if isinstance(fn, Lazy) else str(getattr(fn, "__qualname__", fn))


_FAILED = object()


def _child(rank: int, env: dict[str, str], payload: bytes, results: Any) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    try:
        fn, args = pickle.loads(payload)  # imports fn's module (and torch) only now
        try:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        except ImportError:
            pass
        value = fn(*args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
        value = _FAILED
    finally:
        # A failed rank must not leave the others blocked in a collective forever: the parent
        # ends them once it sees this rank's error.
        results.close()
        results.join_thread()
    if value is not _FAILED:
        # fn returned and its result is delivered: skip the interpreter's teardown of torch and
        # megatron (0.6-0.9 s at every trainer exit on the 2-core machine); what fn opened, it closed
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)


def _failure_report(rank: int, tb: str, procs: list[Any], results: Any, fn: Any) -> str:
    """Message for a failed job. A rank that crashed makes its peers fail in their next collective
    ("connection closed by peer"), and that error can arrive first: so wait a moment and name a
    rank that died without a result as the cause, before the first traceback."""
    world = len(procs)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.05)
    reported = {rank}
    try:
        while True:
            r, _, _ = results.get_nowait()
            reported.add(r)
    except (queue.Empty, OSError, ValueError):
        pass
    dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
    head = "".join(f"rank {r} of {world} exited with code {procs[r].exitcode} without a result "
                   f"(running {_name(fn)}); " for r in dead)
    return f"{head}rank {rank} of {world} failed:\n{tb}"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
          threads: int = 1, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` processes; return their results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    payload = pickle.dumps((fn, args))
    rank_env = child_env(threads, {"WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(free_port()), **(env or {})})
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, rank_env, payload, results), daemon=False)
             for r in range(world_size)]
    out: dict[int, Any] = {}

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.terminate()

    previous = signal.signal(signal.SIGTERM, forward) if threading.current_thread() is threading.main_thread() else None
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(out) < world_size:
            try:
                rank, ok, data = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead:
                    # give a message that is in flight a moment to arrive
                    try:
                        rank, ok, data = results.get(timeout=2.0)
                    except queue.Empty:
                        r = dead[0]
                        raise RuntimeError(f"rank {r} of {world_size} exited with code {procs[r].exitcode} "
                                           f"without a result (running {_name(fn)})") from None
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in out]
                    raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout_s}s "
                                       f"(running {_name(fn)})")
                else:
                    continue
            if not ok:
                raise RuntimeError(_failure_report(rank, data, procs, results, fn))
            out[rank] = pickle.loads(data)
        for p in procs:
            p.join(30)
        return [out[r] for r in range(world_size)]
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
