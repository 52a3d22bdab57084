"""Launching one vLLM server for the adapter (``rollout.vllm_backend``): its command line and
environment, waiting for it to come up, watching it afterwards, and the model's tokenizer; and the
adapter's own command line (``adapter_command``), which the fleet and ``headrace launch`` both use.

Guarantees:
- vLLM runs from its own venv with CPU-friendly flags (``engines.args`` appended and winning), dev
  mode (the RL routes), Headrace's weight-transfer engine, and the run token only in its
  environment (``VLLM_API_KEY``), never on a command line; this venv's PYTHONPATH is not passed on.
- ``watch_child``: when the launched vLLM exits while the adapter is not stopping, the adapter is
  sent SIGTERM and ``CHILD_DIED`` is set (the adapter then exits with status 3), so the fleet sees
  the engine's process exit and restarts it, paused or not (a paused fleet probes only
  ``/get_model_info``, which the adapter answers itself).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from headrace.shared.auth import TOKEN_ENV

log = logging.getLogger("headrace.rollout.vllm")


def adapter_command(model: str, host: str, port: int, startup_timeout_s: float, *, python: str | None = None,
                    upstream: str | None = None, args: list[str] | None = None,
                    parent_pid: int | None = None) -> list[str]:
    """``python -m headrace.rollout.vllm_backend`` serving SGLang's API on ``host:port``: it launches
    vLLM from ``python`` (with ``args`` for vLLM) or attaches to ``upstream``; with ``parent_pid``
    it stops when that process is gone."""
    cmd = [sys.executable, "-m", "headrace.rollout.vllm_backend", "--model", model, "--host", host, "--port", str(port),
           "--startup-timeout-s", str(startup_timeout_s)]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    if upstream is not None:
        return cmd + ["--upstream", upstream]
    return cmd + ["--python", str(python), "--", *(args or [])]


def vllm_command(python: str, model: str, port: int, extra: list[str]) -> list[str]:
    """The vLLM server command line (CPU-friendly flags first; ``extra`` may override them)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", "64", "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
            "--distributed-executor-backend", "uni",   # the worker inside the engine core: ~1.5 GB and one start-up less
            "--weight-transfer-config", '{"backend": "headrace"}', *extra]   # headrace_vllm_ext's gloo engine


def vllm_env(token: str | None) -> dict[str, str]:
    """vLLM's environment: dev mode (RL routes), 1 GiB of CPU KV cache, one OpenMP thread."""
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    env.pop("PYTHONPATH", None)   # the vLLM venv must not see this venv's packages
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    if token:
        env["VLLM_API_KEY"] = token   # vLLM reads its --api-key from here: never on a command line
    return env


def wait_started(proc: subprocess.Popen, url: str, timeout_s: float) -> str | None:
    """Poll vLLM's /health with one client, once a second (a fresh client per poll costs CPU that
    vLLM's start-up needs); why it never came up, or None."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"it exited with {proc.returncode} (its log is above)"
            try:
                if client.get(url).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
    return f"{url} not healthy after {timeout_s:.0f} s (rollout.engines.startup_timeout_s)"


CHILD_DIED = threading.Event()


def watch_child(proc: subprocess.Popen, stopping: threading.Event, interval_s: float = 1.0) -> None:
    """A daemon thread: when the launched vLLM exits while this adapter is not stopping, stop the
    adapter too (exit status 3), so that the fleet sees the engine's process exit and restarts it,
    paused or not (a paused fleet probes only ``/get_model_info``, which this adapter answers itself)."""
    def watch() -> None:
        while not stopping.is_set():
            if proc.poll() is not None:
                if not stopping.is_set():
                    log.error("vLLM (pid %d) exited with %s; stopping this adapter", proc.pid, proc.returncode)
                    CHILD_DIED.set()
                    os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(interval_s)

    threading.Thread(target=watch, name="vllm-child-watch", daemon=True).start()


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer for text prompts, or None (they are then refused with a clear 400)."""
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model)
    except Exception as e:  # noqa: BLE001 - text prompts are then refused with a clear 400
        log.warning("no tokenizer for %s (%s): text prompts will be refused", model, e)
        return None
