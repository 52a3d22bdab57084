"""The rollout service on two real vLLM 0.32 engines (an untied Llama) on CPU, into a real buffer.

``headrace rollout serve`` launches two SGLang-API adapters, each launching vLLM from the vLLM venv
(``rollout.engines.backend: vllm``), and pushes groups into ``headrace buffer serve``: valid groups,
n samples each, a logprob per response token. A pause in abort mode during generation keeps the
aborted requests' partial tokens and finishes them after resume (partial rollouts, resumed samples
marked in metadata). Then this process, as trainer rank 0, pushes new weights into both engines
(listed by ``/v1/engines``) through one gloo group: both report the new version and their logprobs
equal the new weights' (``transformers``, teacher-forced) within 1e-4; after ``/v1/resume`` the
groups are tagged with the new version. Last, with the service paused, engine 0's vLLM server is
killed by pid: the fleet restarts that engine (adapter and vLLM, same port) and holds it out of
routing as stale (it serves the model directory's weights, not version 1) while engine 1 stays in.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import VLLM_PYTHON, free_port, kill_groups
from tests.rollout.support import check_groups, write_prompts
from tests.vllm.support import N, STARTUP_TIMEOUT_S, TOKENS, VLLMStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [11, 42, 7, 99, 23, 5, 61, 17]


@pytest.mark.timeout(3000)
def test_two_vllm_engines_fill_the_buffer_pause_resume_and_take_a_weight_sync(tmp_path: Path) -> None:
    from headrace.shared.modelzoo import init_model
    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from tests.vllm.weights import max_diff, perturbed, teacher_forced

    model = init_model("tiny-llama", tmp_path / "tiny-llama")   # untied embeddings
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    cfg: dict[str, Any] = {
        "engines": {"backend": "vllm", "count": 2, "python": str(VLLM_PYTHON), "base_port": free_port(),
                    "startup_timeout_s": STARTUP_TIMEOUT_S, "restart": True, "max_restarts": 1},
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 400))},
        "n_samples_per_prompt": N, "groups_per_step": 4, "max_concurrency": 8,
        "sampling": {"temperature": 1.0, "max_new_tokens": TOKENS, "ignore_eos": True},
    }
    s = VLLMStack(tmp_path / "stack", model, cfg, max_staleness=100)
    pids: list[int] = []
    try:
        s.start()
        st = s.wait(lambda st: st["produced"] >= 4, timeout=600, what="4 groups from vLLM")
        pids = [e["pid"] for e in st["engines"]]
        assert len(st["engines"]) == 2 and all(e["healthy"] for e in st["engines"]), st["engines"]
        engines = s.get("/v1/engines")
        assert len(engines) == 2

        # pause (abort) mid-generation: partial tokens are held, finished after resume
        paused = s.post("/v1/pause", {"mode": "abort"}).json()
        assert s.status()["paused"]
        new = perturbed(model, seed=3)
        with WeightSender([EngineTarget(e["url"], e["world_size"]) for e in engines], backend="gloo",
                          bucket_bytes=128 << 10, timeout_s=300) as sender:
            sender.update([(n, t.contiguous()) for n, t in new.state_dict().items()], weight_version=1)
        assert s.post("/v1/resume", {"weight_version": 1}).status_code == 200   # paused engines hold requests
        for e in engines:   # both engines hold the new weights (untied head included)
            r = httpx.post(f"{e['url']}/generate", timeout=120, json={
                "input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}}).json()
            assert r["meta_info"]["weight_version"] == "1"
            lps = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
            assert max_diff(lps, teacher_forced(new, PROMPT, r["output_ids"])) < 1e-4
        produced = s.status()["produced"]
        s.wait(lambda st: st["produced"] >= produced + 4, timeout=600, what="groups after the weight sync")
        groups = s.lease_all()
        check_groups(groups, vocab, N, TOKENS)
        assert any(x.weight_version == 1 for g in groups for x in g.samples)
        if paused.get("partial"):
            assert any(x.metadata.get("resumed") for g in groups for x in g.samples), paused

        # restart as for SGLang. Paused first, so that engine 1 does not generate while vLLM starts
        # again (the fleet watches health whether paused or not). Engine 0's vLLM server (its
        # adapter's child) is killed by pid; the adapter's /health fails and the fleet relaunches the
        # engine (adapter and vLLM) on its port, held out as stale until a trainer re-pushes
        assert s.post("/v1/pause", {"mode": "abort"}).status_code == 200
        children = Path(f"/proc/{pids[0]}/task/{pids[0]}/children").read_text().split()
        assert children, "the adapter has no vLLM child"
        for child in children:
            os.kill(int(child), signal.SIGKILL)
        st = s.wait(lambda st: st["engines"][0]["restarts"] >= 1 and st["engines"][0]["healthy"], timeout=1200,
                    what="engine 0 restarted after its vLLM server was killed")
        assert st["engines"][0]["stale"] and not st["engines"][1]["stale"], st["engines"]
        assert st["engines"][0]["pid"] != pids[0]
        pids.append(st["engines"][0]["pid"])
        info = httpx.get(f"{engines[0]['url']}/get_model_info", timeout=300).json()
        assert info["backend"] == "vllm" and info["weight_version"] == "0", info
    finally:
        s.stop()
        kill_groups(pids)   # safety net: the fleet stops its engines; never leave one running
