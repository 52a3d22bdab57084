"""Weight sync from the trainer side into a real SGLang 0.5.23 server over gloo.

``shared.weight_sync.WeightSender`` (this process, trainer rank 0, the project's torch) pushes new
weights into a real ``sglang.launch_server`` process (the SGLang venv's torch 2.14.1) through
/init_weights_update_group, /begin_weight_update, /update_weights_from_distributed and
/end_weight_update. Afterwards SGLang's own output logprobs for a fixed prompt must equal the
logprobs of the new weights computed with ``transformers`` (teacher-forced) within 1e-3.

With LoRA (``trainer.lora_sync: merged``) only the targeted weights travel, merged on the trainer, and
SGLang's logprobs equal the trainer's LoRA policy's within 1e-4.

Also checks SGLang's weight-update session rule on the raw HTTP API (update outside a session is
a 400), which the reference engine copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from tests.sglang.sglang_cpu.server import SGLangServer, tiny_model

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPT = [11, 42, 7, 99, 23, 5, 61, 17]
NEW_TOKENS = 12
ATOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("sglang_ws") / "model")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    srv = SGLangServer(model_dir, tmp_path_factory.mktemp("sglang_ws_logs") / "sglang.log").start()
    try:
        yield srv
    finally:
        srv.stop()


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def teacher_forced(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under ``model`` (temperature 1)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def sglang_sample(url: str, temperature: float = 1.0) -> tuple[list[int], list[float], dict]:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": temperature, "ignore_eos": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    res = r.json()
    lps = res["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == res["output_ids"]
    return res["output_ids"], [lp for lp, _, _ in lps], res["meta_info"]


def perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    """The model with every parameter moved by seeded noise (tied embeddings stay tied)."""
    model = hf_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.05 * float(p.std()) + 0.02))
    return model


def test_update_outside_a_session_is_400_and_sessions_do_not_nest(server: SGLangServer) -> None:
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json=body, timeout=60)

    meta = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "none"}
    r = post("/update_weights_from_distributed", meta)
    assert r.status_code == 400 and r.json()["success"] is False
    assert "begin_weight_update" in r.json()["message"]
    r = post("/end_weight_update", {})
    assert r.status_code == 400 and r.json()["success"] is False
    assert post("/begin_weight_update", {}).status_code == 200
    try:
        r = post("/begin_weight_update", {})
        assert r.status_code == 400 and "already open" in r.json()["message"]
    finally:
        assert post("/end_weight_update", {}).status_code == 200
    # the server still serves, on the weights it loaded
    ids, _, meta_info = sglang_sample(server.url, temperature=0.0)
    assert len(ids) == NEW_TOKENS and meta_info["weight_version"] == "default"


def test_weight_sender_into_sglang_logprobs_match_new_weights(server: SGLangServer, model_dir: Path) -> None:
    from headrace.shared.weight_sync import EngineTarget, WeightSender

    base = hf_model(model_dir)
    ids0, lps0, _ = sglang_sample(server.url)
    ref0 = teacher_forced(base, PROMPT, ids0)
    assert max(abs(a - b) for a, b in zip(lps0, ref0)) < ATOL, (lps0, ref0)

    new_model = perturbed(model_dir, seed=1)
    # Hugging Face names, as the trainer exports them (lm_head.weight included when tied)
    new_tensors = [(n, t.contiguous()) for n, t in new_model.state_dict().items()]

    # small buckets: the update spans several /update_weights_from_distributed calls
    with WeightSender([EngineTarget(server.url)], backend="gloo", bucket_bytes=256 << 10, timeout_s=120) as sender:
        sender.update(new_tensors, weight_version=1)
        assert server.model_info()["weight_version"] == "1"
        ids1, lps1, meta1 = sglang_sample(server.url)
        assert meta1["weight_version"] == "1"
        ref1_new = teacher_forced(new_model, PROMPT, ids1)
        ref1_old = teacher_forced(base, PROMPT, ids1)
        assert max(abs(a - b) for a, b in zip(lps1, ref1_new)) < ATOL, (lps1, ref1_new)
        # the check can fail: the old weights give other logprobs for the same tokens
        assert max(abs(a - b) for a, b in zip(lps1, ref1_old)) > 10 * ATOL

        # a second version over the same group: back to the original weights
        sender.update(list(base.state_dict().items()), weight_version=2)
        assert server.model_info()["weight_version"] == "2"
        ids2, lps2, meta2 = sglang_sample(server.url)
        assert meta2["weight_version"] == "2"
        ref2 = teacher_forced(base, PROMPT, ids2)
        assert max(abs(a - b) for a, b in zip(lps2, ref2)) < ATOL, (lps2, ref2)


def _lora_trainer(model_dir: str, url: str) -> dict:
    """Trainer rank 0 (TP=1, its own gloo process): LoRA adapters with non-zero B, then the merged sync
    ``trainer.lora_sync: merged`` sends (only the targeted weights, W + alpha / rank * B A) into SGLang;
    returns SGLang's and the trainer's logprobs of SGLang's sampled tokens."""
    from types import SimpleNamespace

    from headrace.shared.config_sections import LoRAConfig
    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from headrace.trainer.lora import adapter_tensors, apply_lora, load_adapter_tensors
    from headrace.trainer.model import load_model
    from headrace.trainer.parallel import destroy_distributed, init_distributed
    from headrace.trainer.rollout_control import EngineControl

    info = init_distributed(1, 1)
    try:
        model = load_model(model_dir, info)
        apply_lora(model, LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
                   base_path=model_dir, seed=1)
        g = torch.Generator().manual_seed(5)
        load_adapter_tensors(model, {k: (v if "lora_A" in k else torch.randn(v.shape, generator=g) * 0.05)
                                     for k, v in adapter_tensors(model)})
        with WeightSender([EngineTarget(url)], backend="gloo", bucket_bytes=256 << 10, timeout_s=120) as sender:
            names: list[str] = []
            sender.update(((n, names.append(n) or t) for n, t in EngineControl._named(SimpleNamespace(model=model))),
                          weight_version=11)
            ids, lps, meta = sglang_sample(url)
        full = torch.tensor(PROMPT + ids)
        with torch.no_grad():
            lp, _ = model.token_logprobs(full, torch.arange(len(full)), torch.tensor([0, len(full)]),
                                         torch.cat([full[1:], torch.zeros(1, dtype=full.dtype)]))
        return {"names": names, "sglang": lps, "trainer": lp[len(PROMPT) - 1:-1].tolist(),
                "version": meta["weight_version"]}
    finally:
        destroy_distributed()


def test_merged_lora_sync_into_sglang_matches_the_trainer(server: SGLangServer, model_dir: Path) -> None:
    from headrace.trainer.launch import spawn

    res = spawn(_lora_trainer, 1, str(model_dir), server.url, timeout_s=300)[0]
    assert res["version"] == "11" and res["names"]
    assert all(any(f".{t}." in n for t in ("q_proj", "v_proj", "down_proj")) for n in res["names"])
    diff = max(abs(a - b) for a, b in zip(res["sglang"], res["trainer"]))
    print(f"\nmerged LoRA sync into SGLang: {len(res['names'])} tensors, max |logprob diff| {diff:.2e}")
    assert diff < 1e-4, (res["sglang"], res["trainer"])
