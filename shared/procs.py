"""Process plumbing every launcher shares: free ports, child environments, health polling, and
ending a process group we started.

Guarantees: ``stop_group`` signals only the process group of a child started with
``start_new_session=True`` (its own group, so the child's descendants end with it), never a
process by name; it returns once the child has exited or after SIGKILL. ``child_env`` bounds torch
and OpenMP threads and sets ``OMP_WAIT_POLICY=PASSIVE``: on a 2-core machine several spinning
OpenMP pools slow each other down ~30x. Nothing here imports torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import Callable, Mapping, Sequence

import httpx


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` can be bound on ``host`` right now."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def child_env(threads: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: ``threads`` OpenMP/MKL threads, passive waits,
    quiet tokenizers, unbuffered output; ``extra`` last."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid``; False when it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0, kill_wait_s: float = 10.0) -> int | None:
    """SIGTERM the group ``proc`` leads, SIGKILL it after ``grace_s``; returns the exit code
    (None only if even SIGKILL did not end it within ``kill_wait_s``)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if proc.poll() is not None or not signal_group(proc.pid, sig):
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def wait_http(url: str, timeout_s: float, dead: Callable[[], str | None] = lambda: None, *,
              ok: Sequence[int] = (200,), interval_s: float = 0.2) -> None:
    """Poll ``url`` until it answers a status in ``ok``.

    ``dead()`` is checked before each try: a message from it means the service can never come up
    (RuntimeError with that message); after ``timeout_s`` it is a TimeoutError.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        why = dead()
        if why:
            raise RuntimeError(why)
        try:
            if httpx.get(url, timeout=2.0).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")
