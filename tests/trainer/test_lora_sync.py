"""Merged LoRA weight sync end to end: a TP=2 LoRA trainer (two real gloo processes) pushes what
``EngineControl`` sends with ``trainer.lora_sync: merged`` (only the targeted weights, W + alpha /
rank * B A) through the real ``WeightSender`` into a real reference engine serving the base; the
engine's logprobs then equal the trainer's to 1e-4. A second sync with other adapters replaces
the first (the engine does not accumulate deltas). ~40 s on the 2-core machine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import pytest

from tests.procs import Proc, child_env, free_port, headrace_cmd

PROMPT = [5, 9, 14, 3, 22, 7, 11, 4]
NEW_TOKENS = 8
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def _greedy(url: str) -> dict:
    r = httpx.post(f"{url}/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model("tiny-qwen2", tmp_path_factory.mktemp("models") / "base", seed=0)


@pytest.fixture(scope="module")
def engine(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = Proc(headrace_cmd("engine", "serve", "--model", str(base), "--port", str(port), "--threads", "1",
                             "--weight-sync-timeout", "60"), tmp_path_factory.mktemp("engine") / "engine.log",
                env=child_env(threads=1))
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/health", timeout=120)
        yield url
    finally:
        proc.stop()


def _trainer(model_dir: str, url: str) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from headrace.shared.config_sections import LoRAConfig
    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from headrace.trainer.lora import adapter_tensors, apply_lora, load_adapter_tensors
    from headrace.trainer.model import load_model
    from headrace.trainer.parallel import destroy_distributed, init_distributed
    from headrace.trainer.rollout_control import EngineControl

    info = init_distributed(2, 1)
    try:
        model = load_model(model_dir, info)
        apply_lora(model, LoRAConfig(rank=8, alpha=16, target_modules=TARGETS), base_path=model_dir, seed=1)
        full = {k: v for k, v in adapter_tensors(model)}
        box = [full]
        dist.broadcast_object_list(box, src=0)
        sender = WeightSender([EngineTarget(url)], bucket_bytes=64 << 10, timeout_s=120) if info.rank == 0 else None
        if sender:
            sender.connect()
        out: dict[str, Any] = {"syncs": []}
        try:
            for version, seed in ((1, 3), (2, 4)):
                g = torch.Generator().manual_seed(seed)
                load_adapter_tensors(model, {k: (v if "lora_A" in k else torch.randn(v.shape, generator=g) * 0.05)
                                             for k, v in box[0].items()})
                named = EngineControl._named(SimpleNamespace(model=model))
                gen = None
                if sender:
                    names = []
                    sender.update(((n, names.append(n) or t) for n, t in named), weight_version=version)
                    gen = _greedy(url)
                else:
                    for _ in named:
                        pass
                gbox = [gen]
                dist.broadcast_object_list(gbox, src=0)
                ids = PROMPT + gbox[0]["output_ids"]
                with torch.no_grad():
                    lp, _ = model.token_logprobs(torch.tensor(ids), torch.arange(len(ids)),
                                                 torch.tensor([0, len(ids)]), torch.tensor(ids[1:] + [0]))
                if sender:
                    out["syncs"].append({"names": names, "gen": gbox[0], "stats": dict(sender.last_stats),
                                         "trainer": lp[len(PROMPT) - 1:len(ids) - 1].tolist()})
        finally:
            if sender:
                sender.shutdown()
        return out if info.rank == 0 else None
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_merged_sync_makes_the_engine_compute_the_lora_policy(engine: str, base: Path) -> None:
    from headrace.trainer.launch import spawn

    before = _greedy(engine)["output_ids"]
    res = spawn(_trainer, 2, str(base), engine, timeout_s=400)[0]
    import json

    layers = {str(i) for i in range(json.loads((base / "config.json").read_text())["num_hidden_layers"])}
    for version, sync in enumerate(res["syncs"], start=1):
        names = sync["names"]
        assert names and all(n.endswith(".weight") and any(f".{t}." in n for t in TARGETS) for n in names)
        assert {n.split(".")[2] for n in names} == layers
        assert len(names) == len(set(names)) == len(TARGETS) * len(layers), "only the targeted weights are sent"
        gen = sync["gen"]
        assert gen["meta_info"]["weight_version"] == str(version)
        engine_lp = [lp for lp, _, _ in gen["meta_info"]["output_token_logprobs"]]
        assert engine_lp == pytest.approx(sync["trainer"], abs=1e-4)
    assert res["syncs"][0]["gen"]["output_ids"] != before, "the first adapters changed the model"
