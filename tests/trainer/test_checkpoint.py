"""Checkpoint/resume exactness at TP=2 in real gloo processes: a run that stops after step 2 and
resumes in fresh processes computes step 3 with bit-identical loss, metrics and weights to a run
that never stopped. Also: a layout change is refused, and HF export writes the current policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headrace.shared.config import TrainerConfig
from tests.trainer.support import make_groups
from headrace.trainer.launch import spawn

CFG = dict(lr=2e-3, lr_schedule="cosine", warmup_steps=1, steps=5, min_lr=1e-4, ppo_epochs=2, entropy_coef=0.01,
           micro_batch_tokens=40, weight_decay=0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model("micro-qwen2", tmp_path_factory.mktemp("model") / "micro-qwen2", seed=7)


def _state(model_dir: str, tp: int, dp: int):
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.parallel import init_distributed
    from headrace.trainer.step import TrainerState

    info = init_distributed(tp, dp)
    tcfg = TrainerConfig(**CFG)
    model = load_model(model_dir, info)
    opt = build_optimizer(model, tcfg)
    return TrainerState(model, opt, build_scheduler(opt, tcfg), tcfg, info)


def _batches(vocab: int):
    from headrace.trainer.batch import build_batch

    return [build_batch(make_groups(seed=s), vocab_size=vocab) for s in (11, 12, 13)]


def _uninterrupted(model_dir: str, ckpt: str, tp: int) -> dict | None:
    from headrace.trainer.checkpoint import save_checkpoint
    from headrace.trainer.parallel import destroy_distributed
    from headrace.trainer.step import train_step

    st = _state(model_dir, tp, 1)
    try:
        batches = _batches(st.model.arch.vocab_size)
        metrics = []
        for i, b in enumerate(batches):
            metrics.append(train_step(st, b))
            st.policy_version += 1
            st.groups_consumed += b.num_groups
            if i == 1:
                save_checkpoint(st, ckpt)
        params = {k: v.clone() for k, v in st.model.hf_state_dict()}
        return {"metrics": metrics, "params": params} if st.info.rank == 0 else None
    finally:
        destroy_distributed()


def _resumed(model_dir: str, ckpt: str, tp: int, export_to: str | None) -> dict | None:
    from headrace.trainer.checkpoint import export_hf, latest_checkpoint, load_checkpoint
    from headrace.trainer.parallel import destroy_distributed
    from headrace.trainer.step import train_step

    st = _state(model_dir, tp, 1)
    try:
        torch.manual_seed(999)  # disturb the RNG: the checkpoint must restore it
        meta = load_checkpoint(st, latest_checkpoint(ckpt))
        m3 = train_step(st, _batches(st.model.arch.vocab_size)[2])
        params = {k: v.clone() for k, v in st.model.hf_state_dict()}
        if export_to:
            export_hf(st, export_to, model_dir)
        return {"meta": meta, "m3": m3, "params": params, "step": st.step} if st.info.rank == 0 else None
    finally:
        destroy_distributed()


def _wrong_layout(model_dir: str, ckpt: str) -> str:
    from headrace.trainer.checkpoint import latest_checkpoint, load_checkpoint
    from headrace.trainer.parallel import destroy_distributed

    st = _state(model_dir, 1, 1)
    try:
        load_checkpoint(st, latest_checkpoint(ckpt))
        return "loaded"
    except ValueError as e:
        return str(e)
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_resume_reproduces_next_step_exactly(model_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    (a, _) = spawn(_uninterrupted, 2, str(model_dir), str(ckpt), 2, timeout_s=400)
    assert (ckpt / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in (ckpt / "step_00000002").iterdir()) == [
        "meta.json", "model_tp0.pt", "model_tp1.pt", "rng_rank0.pt", "rng_rank1.pt"]
    hf_dir = tmp_path / "hf"
    (b, _) = spawn(_resumed, 2, str(model_dir), str(ckpt), 2, str(hf_dir), timeout_s=400)
    assert b["meta"]["step"] == 2 and b["meta"]["policy_version"] == 2 and b["meta"]["groups_consumed"] == 8
    assert b["step"] == 3
    want = a["metrics"][2]
    assert want["loss"] != 0.0 and want["clip_fraction"] > 0  # a step with real content
    for k in ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm", "lr"):
        assert b["m3"][k] == want[k], k                         # bit-identical, not approximately
    for k, v in a["params"].items():
        assert torch.equal(b["params"][k], v), k
    # HF export of the resumed policy holds exactly the trained weights
    from safetensors.torch import load_file

    exported = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        exported.update(load_file(str(f)))
    assert (hf_dir / "config.json").is_file()
    for k, v in b["params"].items():
        assert torch.equal(exported[k], v), k
    msg = spawn(_wrong_layout, 1, str(model_dir), str(ckpt), timeout_s=200)[0]
    assert "tp=2" in msg and "tp=1" in msg
