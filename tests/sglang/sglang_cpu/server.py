"""Start a real SGLang 0.5.23 server (or sglang-router 0.3.x) on CPU for the ``sglang`` test tier.

The processes run from the SGLang venv built by ``scripts/build_sglang_venv.sh`` (its python is
``tests.procs.SGLANG_PYTHON``), with the CPU flags SGLang needs on a machine without a GPU and
the test-only ``sgl_kernel`` stand-in installed in that venv. Nothing here imports sglang.

Guarantees:
- ``SGLangServer.start`` returns once ``/health`` answers 200, or raises with the log tail.
- ``stop`` ends only the process group this helper started (SIGTERM, then SIGKILL); SGLang's
  scheduler and detokenizer children are in that group.
- Logprob comparisons need ``--dtype float32`` (``auto`` turns fp32 weights into fp16 on CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from tests.procs import SGLANG_PYTHON, Proc, child_env, free_port

# The flags that make SGLang 0.5.23 run on a CPU-only host (see DESIGN.md, "SGLang facts").
# On CPU --mem-fraction-static is only a start-up sanity check against the host's *available*
# memory (it must stay above 1 - available_after_load / available_before_load); 0.5 tolerates
# other processes allocating memory meanwhile. The KV pool itself is capped by --max-total-tokens.
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--dtype", "float32", "--max-total-tokens", "8192",
            "--mem-fraction-static", "0.5", "--sleep-on-idle", "--skip-server-warmup"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
STARTUP_TIMEOUT_S = 400.0   # ~20 s on an idle 2-core box; minutes when it is shared


def sglang_python() -> Path:
    return SGLANG_PYTHON


def sglang_env(threads: int = 1) -> dict[str, str]:
    """Child environment for SGLang processes: CPU engine on, bounded torch threads."""
    env = child_env(threads, **CPU_ENV)
    env.pop("PYTHONPATH", None)   # the SGLang venv must not see the project's packages
    return env


@dataclass
class SGLangServer:
    """A real SGLang server serving ``model_dir`` on 127.0.0.1; ``url`` once started."""

    model_dir: Path
    log: Path
    port: int = field(default_factory=free_port)
    extra_args: Sequence[str] = ()
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(sglang_python()), "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), *CPU_ARGS, *self.extra_args]

    def start(self, wait: bool = True) -> "SGLangServer":
        self.proc = Proc(self.command(), self.log, env=sglang_env())
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        assert self.proc is not None
        self.proc.wait_http(f"{self.url}/health", timeout=timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=20.0)

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.kill9()

    def model_info(self) -> dict:
        return httpx.get(f"{self.url}/get_model_info", timeout=30).json()


@dataclass
class SGLangRouterProc:
    """sglang-router 0.3.x in front of workers added later with ``POST /workers``."""

    log: Path
    port: int = field(default_factory=free_port)
    extra_args: Sequence[str] = ()
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SGLangRouterProc":
        cmd = [str(sglang_python()), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), *self.extra_args]
        self.proc = Proc(cmd, self.log, env=sglang_env())
        self.proc.wait_http(f"{self.url}/workers", timeout=STARTUP_TIMEOUT_S)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=15.0)


def tiny_model(out: Path, preset: str = "tiny-qwen2") -> Path:
    """A small float32 HF model directory (config, safetensors, tokenizer) made offline."""
    from headrace.shared.modelzoo import init_model

    if not (out / "config.json").exists():
        init_model(preset, out)
    return out


def sglang_available() -> bool:
    return os.path.exists(sglang_python())
