"""Start a real vLLM 0.32 server on CPU behind Headrace's SGLang-API adapter for the ``vllm`` tier.

vLLM runs from the venv built by ``scripts/build_vllm_venv.sh`` (``tests.procs.VLLM_PYTHON``);
the adapter (``python -m headrace.rollout.vllm_backend``) runs from this venv, launches vLLM on a
private loopback port with the flags of ``rollout.vllm_launch.vllm_command`` and serves SGLang's
API on ``url``. One process group: ``stop`` ends the adapter and vLLM (api server and engine core)
by pid. Startup is 30-60 s on an idle 2-core box, several minutes on a loaded one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tests.procs import VLLM_PYTHON, Proc, child_env, free_port, headrace_cmd
from tests.rollout.support import Stack

STARTUP_TIMEOUT_S = 600.0


@dataclass
class VLLMEngine:
    """vLLM + adapter serving ``model_dir``; ``url`` speaks SGLang's API."""

    model_dir: Path
    log: Path
    port: int = field(default_factory=free_port)
    extra_args: Sequence[str] = ()
    token: str | None = None
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "headrace.rollout.vllm_backend", "--model", str(self.model_dir),
                "--port", str(self.port), "--python", str(VLLM_PYTHON), "--", *self.extra_args]

    def start(self) -> "VLLMEngine":
        env = child_env(1, **({"HEADRACE_TOKEN": self.token} if self.token else {}))
        self.proc = Proc(self.command(), self.log, env=env)
        self.proc.wait_http(f"{self.url}/health", timeout=STARTUP_TIMEOUT_S)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=20.0)


N = 2
TOKENS = 24   # N samples per group and TOKENS tokens per sample in the rollout-tier checks


class VLLMStack(Stack):
    """A buffer and a rollout service whose engines are real vLLM servers (minutes to start here)."""

    def start_rollout(self) -> None:
        self.starts += 1
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port)), self.tmp / f"rollout-{self.starts}.log",
                            env=child_env(HEADRACE_LOG_LEVEL="INFO"))
        self.rollout.wait_http(f"{self.url}/health", timeout=2 * STARTUP_TIMEOUT_S)
