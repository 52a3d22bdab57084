"""``headrace run`` end to end with ``rollout.engines.backend: vllm`` (a real vLLM 0.32 on CPU).

One machine, every service a child process: buffer, rollout (its fleet launches the SGLang-API
adapter, which launches vLLM from the vLLM venv) and trainer. A few GRPO steps must complete with
max_staleness 1, so the trainer's weight sync into vLLM (through the adapter, vLLM's weight-transfer
routes and Headrace's ``headrace`` transfer engine) must work; the reward must reach the metrics, and every child must be gone afterwards.
Colocated placement (on-demand rollout, memory released between phases through vLLM's /sleep): the
run must say that on CPU this frees nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.procs import REPO, VLLM_PYTHON, child_env, free_port, headrace_cmd, kill_groups, pids_running
from tests.vllm.support import STARTUP_TIMEOUT_S

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 3


@pytest.mark.timeout(2400)
def test_headrace_run_with_a_vllm_engine_trains_and_syncs(tiny_model: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(64)))
    out = tmp_path / "run"
    cfg = {
        "model": str(tiny_model),
        "buffer": {"port": free_port(), "max_staleness": 1},
        "rollout": {
            "port": free_port(),
            "engines": {"backend": "vllm", "count": 1, "python": str(VLLM_PYTHON),
                        "base_port": free_port(), "startup_timeout_s": STARTUP_TIMEOUT_S},
            "router": "builtin",
            "data": {"path": str(prompts)},
            "n_samples_per_prompt": 4, "groups_per_step": 2, "max_concurrency": 8,
            "sampling": {"temperature": 1.0, "max_new_tokens": 6},
            "reward": "exact_match",
        },
        "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 30},
        "run": {"out": str(out), "eval_every": 0, "placement": "colocated"},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "headrace-run.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(headrace_cmd("run", "--config", str(config)), stdout=f, stderr=subprocess.STDOUT,
                                env=child_env(), cwd=str(REPO), start_new_session=True)
        try:
            code = proc.wait(timeout=2000)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(60)
    text = log.read_text(errors="replace")
    leftover = pids_running(b"vllm", tiny_model)
    kill_groups(leftover)   # the run must have stopped its engine; clean up before failing
    assert code == 0, text[-6000:]
    assert not leftover, f"vLLM processes left running after headrace run: {leftover}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if "step" in r and r.get("loss") is not None]
    assert [r["step"] for r in trained][-1] == STEPS and len({r["step"] for r in trained}) == STEPS, rows
    assert all(any("reward" in k for k in r) for r in trained), rows
    engine_log = "\n".join(p.read_text(errors="replace") for p in out.rglob("engine-*.log"))
    assert "vllm.entrypoints.openai.api_server" in engine_log, "the run's engine was not a vLLM server"
    # colocated (the default placement) on CPU: the run says that vLLM's /sleep frees nothing here
    assert "frees nothing here (it is GPU-only)" in text, text[:3000]
