"""``shared.procs.stop_group`` ends every process of the group a child leads, not merely the child.

Real processes: a leader started with ``start_new_session=True`` that starts a second process in its
own group and exits at once on SIGTERM, as a server's launcher does while its worker processes are
still shutting down. The worker either ignores SIGTERM (it must be SIGKILLed after the grace
period) or takes a moment to exit after it (stop_group must wait for it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from headrace.shared.procs import group_alive, group_is_ours, stop_group

LEADER = r"""
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])    # same process group
open(sys.argv[2], "w").write(str(worker.pid))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))             # the leader leaves at once
while True:
    time.sleep(0.1)
"""

IGNORES_TERM = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.1)"
SLOW_TO_EXIT = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), open(sys.argv[1], 'w').write('done'),"
                " sys.exit(0)))\nwhile True: time.sleep(0.1)")


def _start(tmp_path: Path, worker: str, *worker_args: str) -> tuple[subprocess.Popen, int]:
    pid_file = tmp_path / "worker.pid"
    code = worker if not worker_args else worker.replace("sys.argv[1]", repr(worker_args[0]))
    leader = subprocess.Popen([sys.executable, "-c", LEADER, code, str(pid_file)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)   # both have installed their signal handlers
    return leader, int(pid_file.read_text())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"   # a zombie left for init


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    leader, worker = _start(tmp_path, IGNORES_TERM)
    try:
        assert stop_group(leader, grace_s=1.0, kill_wait_s=10.0) == 0   # the leader exited on SIGTERM
        assert not group_alive(leader.pid)
        assert _gone(worker)
    finally:
        if group_alive(leader.pid):
            os.killpg(leader.pid, signal.SIGKILL)


def test_a_worker_still_shutting_down_is_waited_for(tmp_path: Path) -> None:
    marker = tmp_path / "worker-finished"
    leader, worker = _start(tmp_path, SLOW_TO_EXIT, str(marker))
    try:
        assert stop_group(leader, grace_s=20.0) == 0
        assert not group_alive(leader.pid) and _gone(worker)
        assert marker.read_text() == "done"   # it finished its own shutdown: no SIGKILL was needed
    finally:
        if group_alive(leader.pid):
            os.killpg(leader.pid, signal.SIGKILL)


def test_a_group_already_gone_is_no_error(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait(30)
    assert stop_group(p, grace_s=1.0) == 0
    assert not group_alive(p.pid)


def test_a_reaped_leaders_pid_taken_by_another_group_is_not_signalled(tmp_path: Path) -> None:
    """Our leader exited and was reaped, and its pid now leads someone else's process group (pid
    reuse, simulated by pointing the reaped child's ``pid`` at another group's leader): stopping
    ours must leave that group alone."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    mine = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        assert mine.wait(30) == 0
        assert group_is_ours(mine)        # reaped, and nothing holds its pid
        mine.pid = other.pid              # what pid reuse would look like
        assert not group_is_ours(mine)
        assert stop_group(mine, grace_s=1.0, kill_wait_s=1.0) == 0
        time.sleep(0.2)
        assert other.poll() is None, "stop_group signalled a group that was not its child's"
    finally:
        other.kill()
        other.wait(30)
