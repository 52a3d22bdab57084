"""One RL train step in real gloo process groups: TP=2 x DP=2 (4 processes) computes the same update
as TP=1 x DP=1 on the same batch, with different micro-batch budgets on each side (so gradient
accumulation is covered too); and in one process, the step moves the policy the way the
advantages say and skips the update on a non-finite gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headrace.shared.config import TrainerConfig
from headrace.trainer.launch import spawn
from tests.trainer.support import make_groups

PRESET = "micro-qwen2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model(PRESET, tmp_path_factory.mktemp("model") / PRESET, seed=3)


def _one_step(model_dir: str, tp: int, dp: int, cfg: dict, groups: list[dict]) -> dict | None:
    from headrace.trainer.batch import build_batch
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.parallel import destroy_distributed, init_distributed
    from headrace.trainer.step import TrainerState, train_step

    info = init_distributed(tp, dp)
    try:
        tcfg = TrainerConfig(**cfg)
        model = load_model(model_dir, info)
        ref = None
        if tcfg.kl_coef > 0:
            ref = load_model(model_dir, info)
            ref.requires_grad_(False)
        opt = build_optimizer(model, tcfg)
        st = TrainerState(model, opt, build_scheduler(opt, tcfg), tcfg, info, ref_model=ref, temperature=0.9)
        batch = build_batch(groups, vocab_size=model.arch.vocab_size)
        metrics = train_step(st, batch)
        params = {k: v.clone() for k, v in model.hf_state_dict()}
        return {"metrics": metrics, "params": params} if info.rank == 0 else None
    finally:
        destroy_distributed()


CONFIGS = {
    "grpo-kl-entropy-tis-epochs": dict(lr=1e-3, algorithm="grpo", kl_coef=0.1, kl_kind="k3", entropy_coef=0.01,
                                       tis_cap=2.0, ppo_epochs=2, mini_batches=2, grad_clip=1.0),
    "gspo-seqmean": dict(lr=1e-3, algorithm="gspo", clip_low=3e-4, clip_high=4e-4, ppo_epochs=2, grad_clip=0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_dp2_equals_tp1_dp1(model_dir, name):
    groups = make_groups()
    base = dict(CONFIGS[name], micro_batch_tokens=24)
    (ref,) = spawn(_one_step, 1, str(model_dir), 1, 1, base, groups, timeout_s=300)
    par = spawn(_one_step, 4, str(model_dir), 2, 2, dict(base, micro_batch_tokens=64), groups, timeout_s=300)[0]
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm", "reward_mean",
                "logprob_mean", "trained_tokens"):
        assert par["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-5), key
    assert ref["metrics"]["grad_norm"] > 0
    assert set(par["params"]) == set(ref["params"])
    moved = 0.0
    for k, v in ref["params"].items():
        torch.testing.assert_close(par["params"][k], v, rtol=0, atol=2e-5, msg=lambda m: f"{k}: {m}")
    # the step did change the weights (the comparison above is not between two untouched models)
    from safetensors.torch import load_file
    orig = load_file(str(model_dir / "model.safetensors"))
    moved = max(float((ref["params"][k] - orig[k]).abs().max()) for k in orig)
    assert moved > 1e-4


def _fused_vs_separate(model_dir: str) -> list[dict]:
    from headrace.trainer.batch import build_batch
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.parallel import destroy_distributed, init_distributed
    from headrace.trainer.step import TrainerState, train_step

    info = init_distributed(1, 1)
    out = []
    try:
        for separate in (False, True):
            tcfg = TrainerConfig(lr=1e-3, micro_batch_tokens=24, separate_old_logprobs=separate)
            model = load_model(model_dir, info)
            opt = build_optimizer(model, tcfg)
            st = TrainerState(model, opt, build_scheduler(opt, tcfg), tcfg, info, temperature=0.9)
            batch = build_batch(make_groups(seed=2), vocab_size=model.arch.vocab_size)
            metrics = [train_step(st, batch) for _ in range(2)]
            out.append({"metrics": metrics, "params": {k: v.clone() for k, v in model.hf_state_dict()}})
        return out
    finally:
        destroy_distributed()


def test_a_single_update_reusing_its_forward_as_old_logprobs_equals_a_separate_pass(model_dir):
    fused, separate = spawn(_fused_vs_separate, 1, str(model_dir), timeout_s=300)[0]
    for mf, ms in zip(fused["metrics"], separate["metrics"]):
        for key in ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm", "logprob_mean",
                    "logprob_pos_adv", "rollout_logprob_abs_diff", "trained_tokens", "tokens"):
            assert mf[key] == pytest.approx(ms[key], rel=1e-6, abs=1e-7), key
        assert mf["clip_fraction"] == 0.0 and abs(mf["approx_kl"]) < 1e-6   # on-policy: ratio 1
    for k, v in separate["params"].items():
        torch.testing.assert_close(fused["params"][k], v, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _local_checks(model_dir: str) -> dict:
    from headrace.trainer.batch import build_batch
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.parallel import destroy_distributed, init_distributed
    from headrace.trainer.step import NonFiniteGradError, TrainerState, train_step

    info = init_distributed(1, 1)
    try:
        tcfg = TrainerConfig(lr=3e-3)
        model = load_model(model_dir, info)
        opt = build_optimizer(model, tcfg)
        st = TrainerState(model, opt, build_scheduler(opt, tcfg), tcfg, info)
        batch = build_batch(make_groups(seed=5), vocab_size=model.arch.vocab_size)
        first = train_step(st, batch)
        lps = [train_step(st, batch)["logprob_pos_adv"] for _ in range(3)]
        # NaN reward sneaking past validation would poison the gradient: the step must refuse
        before = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
        for p in model.parameters():
            p.register_hook(lambda g: g * float("nan"))
        try:
            train_step(st, batch)
            raised = False
        except NonFiniteGradError:
            raised = True
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items() if v is not None)
        return {"first": first["logprob_pos_adv"], "after": lps, "raised": raised, "unchanged": unchanged,
                "step": st.step}
    finally:
        destroy_distributed()


def test_step_raises_logprob_of_positive_advantage_and_refuses_nan(model_dir):
    (r,) = spawn(_local_checks, 1, str(model_dir), timeout_s=300)
    assert r["after"][-1] > r["first"] + 0.05      # positive-advantage responses became likelier
    assert r["raised"] and r["unchanged"]
    assert r["step"] == 4                           # the refused step did not count


VARIANTS = [dict(algorithm="rloo"), dict(algorithm="reinforce_pp"), dict(algorithm="dr_grpo", aggregation="seq_mean_token_sum"),
            dict(algorithm="grpo", aggregation="seq_mean_token_mean", dual_clip=3.0, ppo_epochs=2),
            dict(algorithm="grpo", kl_coef=0.5, kl_in_reward=True, kl_kind="k1", ppo_epochs=2),
            dict(algorithm="grpo", kl_coef=0.5, kl_kind="k2", ppo_epochs=2, lr_schedule="cosine", warmup_steps=2)]


def _variants(model_dir: str) -> list[dict]:
    from headrace.trainer.batch import build_batch
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.parallel import destroy_distributed, init_distributed
    from headrace.trainer.step import TrainerState, train_step

    info = init_distributed(1, 1)
    out = []
    try:
        for v in VARIANTS:
            tcfg = TrainerConfig(lr=1e-3, **v)
            model = load_model(model_dir, info)
            ref = None
            if tcfg.kl_coef > 0:
                ref = load_model(model_dir, info)
                ref.requires_grad_(False)
            opt = build_optimizer(model, tcfg)
            st = TrainerState(model, opt, build_scheduler(opt, tcfg), tcfg, info, ref_model=ref)
            batch = build_batch(make_groups(seed=9), vocab_size=model.arch.vocab_size)
            out.append([train_step(st, batch) for _ in range(2)])
        return out
    finally:
        destroy_distributed()


def test_algorithm_variants_run_and_report(model_dir):
    import math

    res = spawn(_variants, 1, str(model_dir), timeout_s=300)[0]
    for v, (m1, m2) in zip(VARIANTS, res):
        for k in ("loss", "pg_loss", "grad_norm", "entropy", "approx_kl"):
            assert math.isfinite(m2[k]), (v, k)
        assert m1["grad_norm"] > 0, v
        assert "kl" not in m2, v                            # two KL columns, never one that changes meaning
        if v.get("kl_coef"):
            assert m2["kl_ref"] != 0, v                     # the policy left the reference (k1 may be < 0)
        else:
            assert "kl_ref" not in m2, v                    # no reference model: no KL-to-reference column
        if v.get("kl_in_reward"):
            assert m1["kl_ref"] == 0.0, v                    # measured before the first update: policy == reference
            assert m2["reward_mean"] == m1["reward_mean"]  # the rollout's rewards are reported, not KL-shaped
        if v.get("warmup_steps"):
            assert (m1["lr"], m2["lr"]) == pytest.approx((5e-4, 1e-3))      # linear warmup over 2 steps


def test_lr_schedule_shapes():
    from headrace.trainer.optim import lr_factor

    f = lambda s, kind: lr_factor(s, warmup_steps=2, total_steps=12, schedule=kind, min_ratio=0.1)  # noqa: E731
    assert [f(s, "constant") for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    assert f(2, "cosine") == pytest.approx(1.0)
    assert f(7, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)      # half-way through the decay
    assert f(12, "cosine") == pytest.approx(0.1) and f(50, "cosine") == pytest.approx(0.1)
