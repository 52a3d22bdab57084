"""RL math against hand-computed values (numbers worked out on paper, written as literals or as
the explicit arithmetic of the formula in the paper / verl's core_algos)."""

from __future__ import annotations

import math

import pytest
import torch

from headrace.trainer.loss import (aggregate, aggregation_weights, entropy_bonus, group_advantages, gspo_terms,
                          kl_penalty, policy_loss, ppo_clip_terms, ragged_group_advantages, tis_weights)

EPS = 1e-6


def close(t, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(t, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32),
                          atol=tol, rtol=0), (t, expected)


def test_grpo_mean_std_unbiased():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    a = group_advantages(r, 4)
    s1 = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]: sqrt(4*0.25/3)
    s2 = math.sqrt(0.75 / 3)  # [1,1,1,0]: mean .75, sq devs 3*.0625 + .5625 = .75
    close(a, [0.5 / (s1 + EPS), -0.5 / (s1 + EPS), -0.5 / (s1 + EPS), 0.5 / (s1 + EPS),
              0.25 / (s2 + EPS), 0.25 / (s2 + EPS), 0.25 / (s2 + EPS), -0.75 / (s2 + EPS)])
    close(a[:4], [0.866024, -0.866024, -0.866024, 0.866024])


def test_dr_grpo_no_std_and_constant_group():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0])
    close(group_advantages(r, 2, normalize_std=False), [1.0, -1.0, 0.0, 0.0])
    close(group_advantages(r, 2), [1 / (math.sqrt(2) + EPS), -1 / (math.sqrt(2) + EPS), 0.0, 0.0])


def test_single_sample_group_keeps_reward():
    close(group_advantages(torch.tensor([0.7, -0.2]), 1), [0.7, -0.2])


def test_rloo_leave_one_out():
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, estimator="rloo")
    close(a, [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])


def test_reinforce_pp_batch_normalised():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    std = math.sqrt(1.875 / 7)  # mean .625; 5 * .375^2 + 3 * .625^2 = 1.875
    a = group_advantages(r, 4, estimator="reinforce_pp")
    close(a, [(x - 0.625) / (std + EPS) for x in r.tolist()])


def test_advantage_bad_input():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(torch.zeros(4), 2, estimator="ppo")


def test_ragged_groups_exclude_failed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    valid = torch.tensor([True, True, False, True, True])
    a = ragged_group_advantages(r, [3, 2], valid)
    s = math.sqrt(0.5)
    close(a, [0.5 / (s + EPS), -0.5 / (s + EPS), 0.0, 0.0, 0.0])


def test_ppo_clip_hand_values():
    lp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.2, -1.5]])
    loss, m = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2))
    # token 1: ratio e^0.2 = 1.2214 -> clipped to 1.2 -> -1.2; token 2: ratio e^-0.5 = 0.60653, unclipped
    close(loss, (-1.2 - math.exp(-0.5)) / 2)
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["approx_kl"] == pytest.approx(0.15, abs=1e-6)


def test_clip_higher_and_dual_clip():
    lp, old = torch.tensor([0.0]), torch.tensor([-0.24])  # ratio e^0.24 = 1.2712
    loss, clipped, _ = ppo_clip_terms(lp, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    close(loss, [-math.exp(0.24)])  # inside 1 + 0.28: not clipped
    assert clipped.item() == 0.0
    # negative advantage, ratio e^2: PPO loss = 7.389, dual-clip c=3 bounds it to 3
    loss, clipped, _ = ppo_clip_terms(torch.tensor([0.0]), torch.tensor([-2.0]), torch.tensor([-1.0]), dual_clip=3.0)
    close(loss, [3.0])
    assert clipped.item() == 1.0
    loss, _, _ = ppo_clip_terms(torch.tensor([0.0]), torch.tensor([-2.0]), torch.tensor([-1.0]))
    close(loss, [math.exp(2.0)], tol=1e-4)


def test_aggregations():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(aggregate(v, m, "token_mean"), 2.5)              # 10 / 4
    close(aggregate(v, m, "seq_mean_token_mean"), 3.0)     # (6/3 + 4/1) / 2
    close(aggregate(v, m, "seq_mean_token_sum"), 5.0)      # (6 + 4) / 2
    close(entropy_bonus(v, m), 2.5)


def test_aggregation_weights_split_equals_whole():
    torch.manual_seed(0)
    vals = torch.randn(10)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.float32)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        whole = (vals * aggregation_weights(mask, seq, agg, num_tokens=8, num_seqs=4)).sum()
        parts = 0.0
        for sl, local_seq in ((slice(0, 5), seq[:5]), (slice(5, 10), seq[5:] - 2)):
            parts = parts + (vals[sl] * aggregation_weights(mask[sl], local_seq, agg, num_tokens=8, num_seqs=4)).sum()
        close(parts, whole.item())


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    close(kl_penalty(lp, ref, "k1"), [1.0])
    close(kl_penalty(lp, ref, "k2"), [0.5])
    close(kl_penalty(lp, ref, "k3"), [math.exp(-1.0) + 1.0 - 1.0])
    close(kl_penalty(lp, lp, "k3"), [0.0])
    with pytest.raises(ValueError, match="kl kind"):
        kl_penalty(lp, ref, "k4")


def test_gspo_sequence_ratio_value_and_grad():
    lp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.1, -0.9, -1.5])
    adv = torch.tensor([2.0, 2.0, 1.0])
    seq = torch.tensor([0, 0, 1])
    mask = torch.ones(3)
    loss, clipped, seq_lr = gspo_terms(lp, old, adv, mask, seq, clip_low=0.2, clip_high=0.2)
    # seq 0: mean log-ratio 0 -> s = 1 -> loss -2; seq 1: s = e^0.5 = 1.6487 -> clipped to 1.2 -> -1.2
    close(loss.detach(), [-2.0, -2.0, -1.2])
    close(clipped, [0.0, 0.0, 1.0])
    close(seq_lr, [0.0, 0.0, 0.5])
    w = aggregation_weights(mask, seq, "seq_mean_token_mean", num_tokens=3, num_seqs=2)
    (loss * w).sum().backward()
    # d/dlp_t of -A * s with s = exp(lp_t - sg(lp_t) + c): -A * s; weight 1/(2*2) for seq 0, clipped seq 1 has 0
    close(lp.grad, [-2.0 / 4, -2.0 / 4, 0.0])


def test_tis_weights_truncated():
    w = tis_weights(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), cap=1.5)
    close(w, [1.5, math.exp(-1.0)])
