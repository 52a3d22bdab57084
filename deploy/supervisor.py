"""Child-process supervision for ``headrace run``: start, health-check, stop — by pid only.

Guarantees: every child runs in its own process group with bounded torch threads and
``OMP_WAIT_POLICY=PASSIVE`` (several spinning OpenMP pools on 2 cores slow each other ~30x);
``stop_all`` first stops the children started with ``stop_first`` (the trainer: on SIGTERM it
finishes its step against live services and checkpoints it), then sends SIGTERM to every other
child's group, each stage followed by SIGKILL after a grace period (further Ctrl-Cs are ignored
meanwhile), so one Ctrl-C leaves no process behind. Nothing here signals a process it did not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

from headrace.shared.procs import child_env, signal_group, wait_http


def _start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of ``pid``: with the pid it names one process, never a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    out: list[tuple[int, int]] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        kids: list[int] = []
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids += [int(k) for k in task.read_text().split()]
            except OSError:
                pass
        for k in kids:
            t = _start_time(k)
            if t is not None:
                out.append((k, t))
                todo.append(k)
    return out


def headrace_argv(*args: str) -> list[str]:
    """``headrace ARGS`` run by this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "headrace.deploy.cli", *args]


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    _log: IO[bytes] = field(repr=False)
    stop_first: bool = False

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class ChildFailed(RuntimeError):
    """A child exited or never became healthy; the message carries the end of its log."""


class Supervisor:
    """Owns the children of one run; use as a context manager so they are always stopped."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = dict(env or {})   # every child's extra environment (the run token travels here, never in argv)
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], *, threads: int = 1, env: dict[str, str] | None = None,
              stop_first: bool = False) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")
        popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=child_env(threads, {**self.env, **(env or {})}), start_new_session=True)
        child = Child(name, popen, log_path, log, stop_first=stop_first)
        self.children.append(child)
        return child

    def wait_healthy(self, child: Child, url: str, timeout_s: float) -> None:
        def dead() -> str | None:
            if child.alive():
                return None
            return f"exited with code {child.popen.returncode} before it was healthy"

        try:
            wait_http(url, timeout_s, dead)
        except (RuntimeError, TimeoutError) as e:
            raise ChildFailed(f"{child.name}: {e} (log {child.log_path}):\n{child.tail()}") from None

    def check(self) -> None:
        """Raise ChildFailed if a service child died (the trainer's exit is handled by the caller)."""
        for c in self.children:
            if not c.alive() and c.popen.returncode != 0:
                raise ChildFailed(f"{c.name} exited with code {c.popen.returncode} (log {c.log_path}):\n{c.tail()}")

    def stop_all(self, grace_s: float = 20.0) -> None:
        """Stop every child (reverse start order); a further Ctrl-C meanwhile cannot cut this short."""
        import threading

        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self._stop_all(grace_s)
            finally:
                signal.signal(signal.SIGINT, previous)
        else:
            self._stop_all(grace_s)

    def _stop_all(self, grace_s: float) -> None:
        spawned = [d for c in self.children if c.alive() for d in descendants(c.popen.pid)]
        first = [c for c in reversed(self.children) if c.stop_first]
        for stage in (first, [c for c in reversed(self.children) if not c.stop_first]):
            for c in stage:
                if c.alive():
                    signal_group(c.popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in stage:
                try:
                    c.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    signal_group(c.popen.pid, signal.SIGKILL)
                    c.popen.wait(10)
                c._log.close()
        for pid, started in spawned:   # what a child started and failed to stop (e.g. engines of a killed rollout)
            if _start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
