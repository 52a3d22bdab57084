"""Weight sync into vLLM over NCCL and vLLM's /sleep on a GPU (skipped on CPU machines).

Needs a CUDA build of vLLM 0.32 in a venv named by ``HEADRACE_VLLM_GPU_PYTHON`` (``pip install
vllm==0.32.0`` there, plus ``pip install scripts/vllm_ext``), and a CUDA torch in this venv: the
trainer side (``WeightSender(backend="nccl")``, this process) broadcasts from GPU 0 while the vLLM
worker's ``headrace`` weight-transfer engine (``headrace_vllm_ext``, driven through vLLM's
weight-transfer routes) joins the same group with NCCL and receives on its GPU. Afterwards
vLLM's logprobs equal the new weights' within 1e-3 (bf16-free: float32), and ``/sleep`` +
``/wake_up`` (``/release_memory_occupation``, ``/resume_memory_occupation`` through the adapter)
keep the engine serving.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.procs import Proc, child_env, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.gpu, pytest.mark.slow]
GPU_PYTHON = os.environ.get("HEADRACE_VLLM_GPU_PYTHON", "")
PROMPT = [11, 42, 7, 99, 23, 5, 61, 17]


@pytest.mark.skipif(not GPU_PYTHON, reason="HEADRACE_VLLM_GPU_PYTHON (a CUDA vLLM 0.32 venv) is not set")
def test_nccl_weight_sync_and_sleep_on_a_gpu(tiny_model: Path, tmp_path: Path) -> None:
    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from tests.vllm.weights import max_diff, perturbed, teacher_forced

    port = free_port()
    proc = Proc([sys.executable, "-m", "headrace.rollout.vllm_backend", "--model", str(tiny_model), "--port",
                 str(port), "--python", GPU_PYTHON, "--", "--gpu-memory-utilization", "0.2"],
                tmp_path / "vllm.log", env=child_env(1))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=600)
        new = perturbed(tiny_model, seed=2)
        with WeightSender([EngineTarget(url)], backend="nccl", timeout_s=300) as sender:
            sender.update([(n, t.cuda().contiguous()) for n, t in new.state_dict().items()], weight_version=1)
        r = httpx.post(f"{url}/generate", timeout=120, json={
            "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}).json()
        assert r["meta_info"]["weight_version"] == "1"
        lps = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        assert max_diff(lps, teacher_forced(new, PROMPT, r["output_ids"])) < 1e-3
        assert httpx.post(f"{url}/release_memory_occupation", json={}, timeout=120).status_code == 200
        assert httpx.post(f"{url}/resume_memory_occupation", json={}, timeout=120).status_code == 200
    finally:
        proc.stop(timeout=30)
