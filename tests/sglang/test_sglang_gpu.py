"""SGLang endpoints that cannot work on CPU: kept as GPU tests (skipped on CPU machines).

- ``/update_weights_from_tensor`` passes tensors as CUDA IPC handles (on CPU the server cannot
  rebuild them from another process and its scheduler dies: see /work notes and the README table);
- ``/release_memory_occupation`` / ``/resume_memory_occupation`` use torch_memory_saver, which
  needs CUDA (on CPU the scheduler dies with "Found no NVIDIA driver").

These need a full SGLang install with its CUDA kernels (``pip install sglang==0.5.23`` in a venv
on a GPU node), named by ``HEADRACE_SGLANG_GPU_PYTHON``; the CPU test venv built by
``make sglang-venv`` carries the test-only ``sgl_kernel`` stand-in and must never serve on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from tests.procs import Proc, child_env, free_port
from tests.sglang.sglang_cpu.server import STARTUP_TIMEOUT_S, tiny_model

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.slow]

PROMPT = [11, 42, 7, 99, 23, 5, 61, 17]

# Runs inside the GPU SGLang venv: the CUDA tensors must stay alive in this process while the
# server opens their IPC handles, so the whole begin/update/end session happens here.
PUSH_BY_TENSOR = r'''
import json, sys, httpx, torch
from safetensors.torch import load_file
import sgl_kernel
from sglang.srt.utils import MultiprocessingSerializer
assert not getattr(sgl_kernel, "IS_HEADRACE_STANDIN", False), "the CPU test stand-in must not serve on a GPU"
url, model, scale, version = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
named = [(k, (v.float() * scale).to(v.dtype).cuda()) for k, v in load_file(f"{model}/model.safetensors").items()]
c = httpx.Client(timeout=300)
for path, body in [("/begin_weight_update", {}),
                   ("/update_weights_from_tensor", {"serialized_named_tensors":
                        [MultiprocessingSerializer.serialize(named, output_str=True)], "weight_version": version}),
                   ("/end_weight_update", {})]:
    r = c.post(url + path, json=body)
    print(path, r.status_code, r.text, flush=True)
    assert r.status_code == 200, r.text
'''


def gpu_python() -> Path:
    p = os.environ.get("HEADRACE_SGLANG_GPU_PYTHON")
    if not p or not Path(p).exists():
        pytest.skip("set HEADRACE_SGLANG_GPU_PYTHON to the python of a full SGLang 0.5.23 install (with CUDA kernels)")
    return Path(p)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("sglang_gpu") / "model")


@pytest.fixture(scope="module")
def gpu_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    python = gpu_python()
    port = free_port()
    cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--mem-fraction-static", "0.3", "--enable-memory-saver",
           "--enable-weights-cpu-backup"]
    env = child_env(4)
    env.pop("PYTHONPATH", None)
    proc = Proc(cmd, tmp_path_factory.mktemp("sglang_gpu_logs") / "sglang.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=STARTUP_TIMEOUT_S)
        yield url
    finally:
        proc.stop()


def greedy_logprobs(url: str) -> tuple[list[int], list[float], dict]:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    res = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    return res["output_ids"], [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]], res["meta_info"]


def hf_logprobs(model_dir: Path, output: list[int], scale: float) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
        logp = torch.log_softmax(model(torch.tensor([PROMPT + output])).logits[0].float(), -1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(output)]


def test_update_weights_from_tensor_cuda_ipc(gpu_server: str, model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "push.py"
    script.write_text(PUSH_BY_TENSOR)
    out = subprocess.run([str(gpu_python()), str(script), gpu_server, str(model_dir), "0.5", "7"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    ids, lps, meta = greedy_logprobs(gpu_server)
    assert meta["weight_version"] == "7"
    ref = hf_logprobs(model_dir, ids, 0.5)
    assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-3, (lps, ref)


def test_release_and_resume_memory_occupation(gpu_server: str) -> None:
    before = greedy_logprobs(gpu_server)
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = httpx.post(f"{gpu_server}{path}", json={}, timeout=300)
        assert r.status_code == 200, r.text
    info = httpx.get(f"{gpu_server}/get_server_info", timeout=30).json()
    assert json.dumps(info)  # still answers
    # tags None = KV cache and weights; --enable-weights-cpu-backup restores the same weights on resume
    after = greedy_logprobs(gpu_server)
    assert after[0] == before[0]
    assert max(abs(a - b) for a, b in zip(after[1], before[1])) < 1e-5
