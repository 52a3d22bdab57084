"""LoRA checkpoint/resume at TP=2 in real gloo processes: a run that stops after step 2 and resumes in
fresh processes computes step 3 with bit-identical loss and metrics (dropout on, so the RNG restore
counts; KL to the base with adapters off); the checkpoint holds adapters and their optimizer state
only, names the base model and its checksum; the base stays bit-identical; a resume on another base,
another rank or without LoRA is refused; the final export writes ``hf`` (merged) and ``hf-lora``.
~60 s on the 2-core machine (three spawns)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from headrace.shared.config import TrainerConfig
from headrace.trainer.launch import spawn
from tests.trainer.support import make_groups, perturb

CFG = dict(lr=5e-3, lr_schedule="cosine", warmup_steps=1, steps=5, min_lr=1e-4, ppo_epochs=1, entropy_coef=0.01,
           micro_batch_tokens=40, weight_decay=0.01, kl_coef=0.05,
           lora={"rank": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj",
                                                                             "down_proj"]})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model("micro-qwen2", tmp_path_factory.mktemp("model") / "micro-qwen2", seed=7)


def _state(model_dir: str, tp: int, info=None, **over):
    from headrace.trainer.lora import AdaptersOff, apply_lora
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.parallel import init_distributed
    from headrace.trainer.step import TrainerState

    info = info or init_distributed(tp, 1)
    tcfg = TrainerConfig(**{**CFG, **over})
    torch.manual_seed(tcfg.seed)
    model = load_model(model_dir, info)
    ref = None
    if tcfg.lora is not None:
        apply_lora(model, tcfg.lora, base_path=model_dir, seed=tcfg.seed)
        ref = AdaptersOff(model)
    opt = build_optimizer(model, tcfg)
    return TrainerState(model, opt, build_scheduler(opt, tcfg), tcfg, info, ref_model=ref)


def _batches(vocab: int):
    from headrace.trainer.batch import build_batch

    return [build_batch(make_groups(seed=s), vocab_size=vocab) for s in (11, 12, 13)]


def _uninterrupted(model_dir: str, ckpt: str, tp: int) -> dict | None:
    from headrace.trainer.checkpoint import save_checkpoint
    from headrace.trainer.lora import adapter_tensors
    from headrace.trainer.parallel import destroy_distributed
    from headrace.trainer.step import train_step

    st = _state(model_dir, tp)
    try:
        batches = _batches(st.model.arch.vocab_size)
        metrics = []
        for i, b in enumerate(batches):
            metrics.append(train_step(st, b))
            st.policy_version += 1
            if i == 1:
                save_checkpoint(st, ckpt)
        base = dict(st.model.hf_state_dict())
        adapters = dict(adapter_tensors(st.model))
        return {"metrics": metrics, "base": base, "adapters": adapters} if st.info.rank == 0 else None
    finally:
        destroy_distributed()


def _resumed(model_dir: str, ckpt: str, tp: int, export_to: str) -> dict | None:
    from headrace.trainer.checkpoint import export_hf, latest_checkpoint, load_checkpoint
    from headrace.trainer.lora import adapter_tensors
    from headrace.trainer.parallel import destroy_distributed
    from headrace.trainer.step import train_step

    st = _state(model_dir, tp)
    try:
        torch.manual_seed(999)  # disturb the RNG: the checkpoint must restore it (dropout draws from it)
        meta = load_checkpoint(st, latest_checkpoint(ckpt))
        m3 = train_step(st, _batches(st.model.arch.vocab_size)[2])
        adapters = dict(adapter_tensors(st.model))
        export_hf(st, export_to, model_dir)
        return {"meta": meta, "m3": m3, "adapters": adapters} if st.info.rank == 0 else None
    finally:
        destroy_distributed()


def _refused(model_dir: str, ckpt: str, info, over: dict) -> str:
    from headrace.trainer.checkpoint import latest_checkpoint, load_checkpoint

    st = _state(model_dir, info.tp, info, **over)
    try:
        load_checkpoint(st, latest_checkpoint(ckpt))
        return "loaded"
    except ValueError as e:
        return str(e)


@pytest.mark.slow
def test_lora_resume_reproduces_next_step_exactly(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    (a, _) = spawn(_uninterrupted, 2, str(model_dir), str(ckpt), 2, timeout_s=400)
    step2 = ckpt / "step_00000002"
    meta = json.loads((step2 / "meta.json").read_text())
    assert meta["lora"]["base_model"] == str(model_dir) and len(meta["lora"]["base_sha256"]) == 64
    assert (meta["lora"]["rank"], meta["lora"]["alpha"]) == (4, 8.0)
    blob = torch.load(step2 / "model_tp0.pt", weights_only=True)
    assert blob["model"] and all(".lora." in k for k in blob["model"]), "the checkpoint holds adapters only"
    n_adapter = sum(v.numel() for v in blob["model"].values())
    n_state = sum(v.numel() for s in blob["optimizer"]["state"].values() for k, v in s.items() if k != "step")
    assert n_state == 2 * n_adapter, "AdamW state of the adapters only"
    base = load_file(str(model_dir / "model.safetensors"))
    for k, v in a["base"].items():
        assert torch.equal(v.to(base[k].dtype), base[k]), f"base tensor {k} changed: it must stay frozen"
    b_ = next(k for k in a["adapters"] if k.endswith("lora_B.weight"))
    assert a["adapters"][b_].abs().max() > 0, "the adapters trained"

    hf = tmp_path / "hf"
    (b, _) = spawn(_resumed, 2, str(model_dir), str(ckpt), 2, str(hf), timeout_s=400)
    want = a["metrics"][2]
    assert want["loss"] != 0.0 and want["kl_ref"] > 0
    for k in ("loss", "pg_loss", "kl_ref", "entropy", "clip_fraction", "approx_kl", "grad_norm", "lr"):
        assert b["m3"][k] == want[k], k                          # bit-identical, not approximately
    for k, v in a["adapters"].items():
        assert torch.equal(b["adapters"][k], v), k
    assert (hf / "model.safetensors").is_file() and (tmp_path / "hf-lora" / "adapter_model.safetensors").is_file()

    other = tmp_path / "other-base"
    shutil.copytree(model_dir, other)
    perturb(other, seed=3)
    msgs = spawn(_refused_all, 2, str(model_dir), str(other), str(ckpt), timeout_s=300)[0]
    assert "sha256" in msgs["base"] and "same base model" in msgs["base"]
    assert "trainer.lora.rank is 8 but checkpoint" in msgs["rank"]
    assert "trainer.lora is null" in msgs["full"]


def _refused_all(model_dir: str, other: str, ckpt: str) -> dict:
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(2, 1)
    try:
        return {"base": _refused(other, ckpt, info, {}),
                "rank": _refused(model_dir, ckpt, info, {"lora": {**CFG["lora"], "rank": 8}}),
                "full": _refused(model_dir, ckpt, info, {"lora": None, "kl_coef": 0.0})}
    finally:
        destroy_distributed()
