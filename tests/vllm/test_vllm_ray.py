"""``headrace launch`` with ``rollout.engines.backend: vllm`` on a real local Ray (fake GPUs, CPU only).

Ray is started here with logical GPUs (nothing touches CUDA). The engine actor runs Headrace's
SGLang-API adapter, which launches a real vLLM 0.32 (CPU) from the vLLM venv; the rollout service
attaches to the adapter as an external engine and the trainer rank is a Ray actor. A short
colocated run must train its steps, so the trainer's weight sync into vLLM works through the
launcher's wiring, and no vLLM process may outlive the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from headrace.shared.config import load_config
from tests.procs import VLLM_PYTHON, pids_running, start_local_ray
from tests.vllm.support import STARTUP_TIMEOUT_S

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 2


@pytest.fixture
def ray_2gpus() -> Iterator[None]:
    start_local_ray(2, cpus=3)
    yield
    ray.shutdown()


@pytest.mark.timeout(1800)
def test_launch_places_a_vllm_engine_and_trains(tiny_model: Path, tmp_path: Path, ray_2gpus: None) -> None:
    from headrace.deploy.ray_launch import launch_on_ray

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(32)))
    tree = {
        "model": str(tiny_model),
        "buffer": {"max_staleness": 1},
        "rollout": {"engines": {"backend": "vllm", "python": str(VLLM_PYTHON), "startup_timeout_s": STARTUP_TIMEOUT_S},
                    "data": {"path": str(prompts)}, "n_samples_per_prompt": 2, "groups_per_step": 2,
                    "max_concurrency": 4, "sampling": {"temperature": 1.0, "max_new_tokens": 4}, "reward": "exact_match"},
        "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 30, "micro_batch_tokens": 256},
        "run": {"placement": "colocated", "out": str(tmp_path / "run"), "eval_every": 0,
                "num_gpus": {"trainer": 1, "rollout": 1}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        code = launch_on_ray(load_config(path), "colocated")
    finally:
        leftover = pids_running(b"vllm", tiny_model)
        for pid in leftover:   # the launcher must have stopped them; clean up before failing
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out = tmp_path / "run"
    engine_log = (out / "logs" / "engine0.log").read_text(errors="replace")
    assert code == 0
    assert "vllm.entrypoints.openai.api_server" in engine_log, engine_log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if r.get("loss") is not None] == list(range(1, STEPS + 1)), rows
    resolved = load_config(out / "config.yaml")
    assert resolved.rollout.engines.backend == "external" and len(resolved.rollout.engines.urls) == 1
    trainer_log = (out / "logs" / "trainer0.log").read_text(errors="replace")
    assert f"headrace train: done at step {STEPS}" in trainer_log, trainer_log[-3000:]
    assert not leftover, f"vLLM processes left running after headrace launch: {leftover}"
