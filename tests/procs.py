"""Test helpers for real processes on loopback: free ports, start, wait for health, stop by pid.

Tests end only the processes they started (by pid, SIGTERM then SIGKILL), never by name.
``free_port`` hands each xdist worker its own block of ports, below both the kernel's ephemeral
range and the range the services' own ``free_port`` picks from, so no test can be given a port
another test, a service or an outgoing connection holds or is about to bind.
Child processes get few torch threads and OMP_WAIT_POLICY=PASSIVE: on the 2-core machine
spinning OpenMP threads of several processes slow each other down 30x.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from headrace.deploy.supervisor import headrace_argv as headrace_cmd  # noqa: F401  (re-exported for tests)
from headrace.shared.procs import child_env as service_env
from headrace.shared.procs import port_free, signal_group, stop_group, wait_http

REPO = Path(__file__).resolve().parents[1]
# the python of the SGLang venv (`make sglang-venv`) that the `sglang` test tier runs servers with
SGLANG_PYTHON = Path(os.environ.get("HEADRACE_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
VLLM_PYTHON = Path(os.environ.get("HEADRACE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


# Tests' ports: TEST_PORTS split into one block per xdist worker, handed out in steps of PORT_STEP
# (a fleet binds base_port + i for its engines); a port is handed out again only after its whole
# block has been, and only when it can be bound then.
TEST_PORTS = (10000, 14999)
PORT_STEP = 4


def _worker_ports() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) % count if worker.isdigit() else 0
    size = (TEST_PORTS[1] - TEST_PORTS[0] + 1) // count
    start = TEST_PORTS[0] + index * size
    return range(start, start + size - PORT_STEP + 1, PORT_STEP)


_next_port = itertools.cycle(_worker_ports())


def free_port(host: str = "127.0.0.1") -> int:
    """A port of this worker's block that ``host`` can bind now, with the PORT_STEP - 1 above it."""
    for _ in range(len(_worker_ports())):
        port = next(_next_port)
        if all(port_free(port + i, host) for i in range(PORT_STEP)):
            return port
    raise RuntimeError(f"no free port left in this worker's block of {TEST_PORTS}")


def child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """Environment for a child process: quiet OpenMP, bounded threads, repo on the path."""
    env = service_env(threads)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _default_sigint() -> None:
    """In the child: SIGINT acts as a terminal's Ctrl-C. A test run started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Proc:
    """A child process with its log file; ``stop()`` ends it and only it."""

    def __init__(self, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.cmd = list(cmd)
        self.log_path = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")
        self.popen = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                      env=env or child_env(), cwd=str(cwd or REPO),
                                      start_new_session=True, preexec_fn=_default_sigint)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 60.0, ok=(200,)) -> None:
        """Poll ``url`` until it answers one of ``ok``; fail with the log if the process dies."""
        def dead() -> str | None:
            return None if self.alive() else f"process exited ({self.popen.returncode}) before {url} was up"

        try:
            wait_http(url, timeout, dead, ok=ok, interval_s=0.1)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.log()[-4000:]}") from None

    def kill9(self) -> None:
        """SIGKILL this process (and the process group it leads) without any cleanup."""
        if self.alive():
            signal_group(self.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        stop_group(self.popen, timeout)
        self._log.close()
        return self.popen.returncode


def pids_running(words: bytes, model_dir: Path) -> list[int]:
    """PIDs of processes whose command line holds ``words`` and names ``model_dir`` (a safety net
    after a run that must have stopped its engines)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = b" ".join((proc / "cmdline").read_bytes().split(b"\0"))
        except OSError:
            continue
        if words in cmd and str(model_dir).encode() in cmd:
            pids.append(int(proc.name))
    return pids


RAY_CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                 "TOKENIZERS_PARALLELISM": "false"}


def start_local_ray(gpus: int, cpus: int = 2) -> None:
    """A local Ray in this process with ``gpus`` logical GPUs (Ray schedules them; nothing touches
    CUDA) and bounded threads in every worker."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": RAY_CHILD_ENV})


def kill_groups(pids: Sequence[int]) -> None:
    """Safety net after a test: SIGKILL the process group each pid leads (groups already gone are skipped)."""
    for pid in pids:
        signal_group(pid, signal.SIGKILL)


@contextmanager
def reference_engine(model_dir: Path, log: Path, *args: str) -> Iterator[tuple[str, Proc]]:
    """``headrace engine serve`` (1 torch thread) on a free port, healthy: yields (url, process)."""
    port = free_port()
    proc = Proc(headrace_cmd("engine", "serve", "--model", str(model_dir), "--port", str(port), "--threads", "1",
                             *args), log, env=child_env(threads=1))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=120)
        yield url, proc
    finally:
        proc.stop()
