"""``headrace run`` end to end with a real SGLang 0.5.23 engine on CPU.

One machine, every service a child process: buffer, rollout (launching one SGLang server from the
SGLang venv, ``rollout.engines.backend: sglang``) and trainer; a few GRPO steps must complete,
with metrics written per step and every child stopped afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.procs import REPO, child_env, free_port, headrace_cmd, kill_groups, pids_running
from tests.sglang.sglang_cpu.server import CPU_ARGS, CPU_ENV, STARTUP_TIMEOUT_S, sglang_python, tiny_model

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

STEPS = 3


@pytest.mark.timeout(2400)
def test_headrace_run_with_an_sglang_engine_completes_steps(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(64)))
    out = tmp_path / "run"
    cfg = {
        "model": str(model),
        # staleness >= STEPS: this test is about the SGLang backend, so it must not depend on whether
        # weight sync to the engines is wired in yet (without it every group stays at version 0)
        "buffer": {"port": free_port(), "max_staleness": STEPS},
        "rollout": {
            "port": free_port(),
            "engines": {"backend": "sglang", "count": 1, "python": str(sglang_python()), "args": CPU_ARGS,
                        "base_port": free_port(), "startup_timeout_s": STARTUP_TIMEOUT_S},
            "router": "builtin",
            "data": {"path": str(prompts)},
            "n_samples_per_prompt": 4, "groups_per_step": 2, "max_concurrency": 8,
            "sampling": {"temperature": 1.0, "max_new_tokens": 6},
            "reward": "exact_match",
        },
        "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 30},
        "run": {"out": str(out), "eval_every": 0},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "headrace-run.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(headrace_cmd("run", "--config", str(config)), stdout=f, stderr=subprocess.STDOUT,
                                env=child_env(**CPU_ENV), cwd=str(REPO), start_new_session=True)
        try:
            code = proc.wait(timeout=2000)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(60)
    text = log.read_text(errors="replace")
    leftover = pids_running(b"sglang.launch_server", model)
    kill_groups(leftover)   # the run must have stopped its engine; clean up before failing
    assert code == 0, text[-6000:]
    assert not leftover, f"SGLang engines left running after headrace run: {leftover}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows if "step" in r and r.get("loss") is not None]
    assert steps[-1] == STEPS and len(set(steps)) == STEPS, rows
    engine_log = "\n".join(p.read_text(errors="replace") for p in out.rglob("engine-*.log"))
    assert "sglang" in engine_log.lower(), "the run's engine was not an SGLang server"
