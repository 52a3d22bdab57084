"""Process plumbing every launcher shares: free ports, child environments, health polling, and
ending a process group we started.

``free_port`` picks below the kernel's ephemeral range, so no outgoing connection can take the port
between the pick and the child's bind.

Guarantees: ``stop_group`` signals only the process group of a child started with
``start_new_session=True`` (its own group, so the child's descendants end with it), never a
process by name; it returns once every process of that group has exited (SIGKILL for what is
left after the grace period), not merely the child. Once the child has been reaped its pid may be
reused; ``stop_group`` then signals the group only while no process holds that pid (Linux does not
hand out a pid that is still a live group's id, so a process holding it means the group is gone and
the id belongs to someone else). ``child_env`` bounds torch
and OpenMP threads and sets ``OMP_WAIT_POLICY=PASSIVE``: on a 2-core machine several spinning
OpenMP pools slow each other down ~30x. Nothing here imports torch.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from typing import Callable, Mapping, Sequence

import httpx


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# Where ``free_port`` picks: below the kernel's ephemeral range (32768+ by default), where bind(0)
# and every outgoing connection take their ports, so a port picked there can be taken before the
# child that was given it binds it; and below 22000-29999, where SGLang picks its own.
PICK_RANGE = (15000, 21999)
PICK_ATTEMPTS = 64


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` can be bound on ``host`` right now (without SO_REUSEADDR, so a port still
    in TIME_WAIT counts as taken)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", pick: tuple[int, int] = PICK_RANGE) -> int:
    """A TCP port that is free on ``host`` right now, for a child to bind later: a random one of
    ``pick`` (outside the ephemeral range, see ``PICK_RANGE``); the OS's choice if none of
    ``PICK_ATTEMPTS`` tries is free."""
    low, high = pick
    for port in random.sample(range(low, high + 1), min(PICK_ATTEMPTS, high - low + 1)):
        if port_free(port, host):
            return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def _exists(probe: Callable[[int, int], None], ident: int) -> bool:
    """Signal 0 through ``probe`` (``os.kill`` or ``os.killpg``): whether ``ident`` names a live
    process or group (a zombie included; one we may not signal exists too)."""
    try:
        probe(ident, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def group_alive(pgid: int) -> bool:
    """Whether any process (a zombie leader included) is still in process group ``pgid``."""
    return _exists(os.killpg, pgid)


def group_is_ours(proc: subprocess.Popen) -> bool:
    """Whether the process group with ``proc``'s pid as its id can still be the one ``proc`` led:
    always while ``proc`` is not reaped (its pid is held); after that only while no process holds
    the pid. While any member of a group lives the kernel reuses neither its id as a pid nor as a
    new group's id, so a reaped leader's pid held by a process means our group has ended and a
    later process (perhaps a new group's leader) has that id."""
    return proc.returncode is None or not _exists(os.kill, proc.pid)


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0, kill_wait_s: float = 10.0) -> int | None:
    """SIGTERM the group ``proc`` leads and wait up to ``grace_s`` until every process of the group
    has exited, the leader and what it started in its group alike (a server's worker processes may
    outlive it by seconds while they shut down); SIGKILL the group if any is left, and wait up to
    ``kill_wait_s`` for that. Returns the leader's exit code (None only if even SIGKILL did not end
    it). A group whose id another process has taken since ``proc`` was reaped is never signalled
    (``group_is_ours``)."""
    def ended() -> bool:   # poll first: it reaps the leader
        return proc.poll() is not None and (not group_is_ours(proc) or not group_alive(proc.pid))

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if ended():
            break
        if not signal_group(proc.pid, sig):
            proc.poll()
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if ended():
                return proc.returncode
            time.sleep(0.05)
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
