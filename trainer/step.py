"""One RL training step on one rank of a TP x DP trainer.

``train_step(state, batch)`` runs, in order: pack this DP rank's share of the batch into token-budget
micro-batches -> recompute old logprobs (and reference logprobs when KL is on) with the current
weights (with one epoch and one mini-batch the update's own forward, detached, gives the old
logprobs: the weights cannot have changed in between) -> advantages per group (KL optionally folded into the reward first) -> for each PPO epoch
and mini-batch: forward, loss, backward per micro-batch (gradient accumulation), sum gradients over
DP, clip the global grad norm, optimizer step -> advance the LR schedule. It returns the step's
metrics, identical on every rank. Two KL metrics that never stand in for each other: ``approx_kl``
(token mean of log old - log new, how far the update moved the policy; every step) and ``kl_ref``
(the ``kl_kind`` estimate of KL to the frozen reference; only when ``kl_coef > 0``).

Guarantees:
- Every rank must call it with the same ``TrainBatch`` (the loop broadcasts it). Loss weights use
  batch-global token and sequence counts, so TP=a x DP=b computes the same update as TP=1 x DP=1
  up to float reordering, and micro-batch size does not change the update.
- Failed samples and tokens with loss mask 0 contribute nothing (they are not even packed).
- A non-finite gradient norm raises ``NonFiniteGradError`` *before* the optimizer step of that
  mini-batch; gradients are cleared. With one mini-batch (the default) the model is unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from headrace.shared.config import TrainerConfig
from headrace.trainer.batch import MicroBatch, TrainBatch, pack, shard_for_dp
from headrace.trainer.loss import (aggregation_weights, gspo_terms, kl_penalty, ppo_clip_terms, ragged_group_advantages,
                          tis_weights)
from headrace.trainer.optim import allreduce_grads, clip_grad_norm

# algorithm -> (advantage estimator, std normalisation, loss kind)
ALGORITHMS: dict[str, tuple[str, bool, str]] = {
    "grpo": ("grpo", True, "ppo"),
    "dr_grpo": ("grpo", False, "ppo"),
    "rloo": ("rloo", False, "ppo"),
    "reinforce_pp": ("reinforce_pp", True, "ppo"),
    "gspo": ("grpo", True, "gspo"),
}


class NonFiniteGradError(FloatingPointError):
    """The gradient norm was NaN/inf; the optimizer step was skipped."""


@dataclass
class TrainerState:
    """Everything a step reads or changes; ``checkpoint.py`` saves and restores all of it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    cfg: TrainerConfig
    info: Any                          # trainer.parallel.ParallelInfo
    ref_model: nn.Module | None = None
    temperature: float = 1.0           # logits are divided by the rollout's sampling temperature
    step: int = 0                      # training steps done
    policy_version: int = 0
    groups_consumed: int = 0
    samples_consumed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _logprobs(model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool):
    return model.token_logprobs(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.target_ids,
                                temperature=temperature, with_entropy=with_entropy)


def _dp_sum(values: list[float], info: Any) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=getattr(info, "device", None))  # NCCL: on the GPU
    if info.dp > 1:
        dist.all_reduce(t, group=info.dp_group)
    return t.tolist()


def _chunks(batch: TrainBatch, n: int) -> list[list[int]]:
    """Sample ids of ``n`` mini-batches made of whole groups (as even as possible)."""
    n = max(1, min(n, batch.num_groups))
    starts = [0]
    for size in batch.group_sizes:
        starts.append(starts[-1] + size)
    bounds = [round(k * batch.num_groups / n) for k in range(n + 1)]
    return [list(range(starts[bounds[k]], starts[bounds[k + 1]])) for k in range(n)]


def _policy_stats(mbs: list[MicroBatch], info: Any) -> dict[str, float]:
    """Train-vs-rollout mismatch and policy statistics on the old logprobs, summed over DP."""
    s = dict.fromkeys(["tok", "lp_sum", "pos_tok", "pos_lp", "r_tok", "r_abs", "r_diff", "tokens"], 0.0)
    for mb in mbs:
        m, old = mb.loss_mask, mb.extras["old"]
        s["tok"] += float(m.sum())
        s["lp_sum"] += float((old * m).sum())
        pos = m * (mb.extras["adv"] > 0)
        s["pos_tok"] += float(pos.sum())
        s["pos_lp"] += float((old * pos).sum())
        rm = m * mb.has_rollout
        d = (old - mb.rollout_logprobs) * rm
        s["r_tok"] += float(rm.sum())
        s["r_abs"] += float(d.abs().sum())
        s["r_diff"] += float(d.sum())
        s["tokens"] += mb.num_tokens
    keys = list(s)
    return dict(zip(keys, _dp_sum([s[k] for k in keys], info)))


def train_step(st: TrainerState, batch: TrainBatch) -> dict[str, float]:
    """Train on ``batch`` (see the module docstring); returns metrics (same on every rank)."""
    t0 = time.perf_counter()
    cfg, info, model = st.cfg, st.info, st.model
    estimator, default_norm, kind = ALGORITHMS[cfg.algorithm]
    normalize = default_norm if cfg.normalize_std is None else cfg.normalize_std
    aggregation = "seq_mean_token_mean" if kind == "gspo" else cfg.aggregation
    use_ref = cfg.kl_coef > 0 and st.ref_model is not None
    device = getattr(info, "device", torch.device("cpu"))

    # ---- layout: mini-batches of whole groups, this rank's share of each, packed
    chunks = _chunks(batch, cfg.mini_batches)
    plan: list[tuple[list[MicroBatch], float, float]] = []
    for ids in chunks:
        trainable = [i for i in ids if batch.samples[i].trained_tokens > 0]
        shard = shard_for_dp([len(batch.samples[i].tokens) - 1 for i in trainable], info.dp)[info.dp_rank]
        mbs = [mb.to(device) for mb in pack(batch, [trainable[k] for k in shard], cfg.micro_batch_tokens)]
        plan.append((mbs, float(sum(batch.samples[i].trained_tokens for i in trainable)), float(len(trainable))))
    all_mbs = [mb for mbs, _, _ in plan for mb in mbs]

    # ---- old (and reference) logprobs with the weights before this step. With a single update
    # (one epoch, one mini-batch) nothing changes the weights before the update's own forward, so
    # its detached logprobs are the old ones: one forward pass fewer (unless KL goes into rewards,
    # which needs them before the advantages).
    fused_old = (cfg.ppo_epochs == 1 and len(plan) == 1 and not (use_ref and cfg.kl_in_reward)
                 and not cfg.separate_old_logprobs
                 and not (cfg.lora is not None and cfg.lora.dropout > 0))   # LoRA dropout: old logprobs without it
    model.eval()
    with torch.no_grad():
        for mb in all_mbs:
            if not fused_old:
                mb.extras["old"] = _logprobs(model, mb, st.temperature, False)[0].float()
            if use_ref:
                mb.extras["ref"] = _logprobs(st.ref_model, mb, st.temperature, False)[0].float()
    model.train()

    # ---- advantages (global: every rank holds the whole batch's rewards)
    rewards, valid = batch.rewards()
    if use_ref and cfg.kl_in_reward:
        kl_sum = torch.zeros(len(batch.samples), dtype=torch.float64, device=device)  # per sample, over tokens
        for mb in all_mbs:
            per_tok = kl_penalty(mb.extras["old"], mb.extras["ref"], cfg.kl_kind) * mb.loss_mask
            per_seq = torch.zeros(len(mb.sample_ids), device=device).index_add_(0, mb.seq_index, per_tok)
            kl_sum[mb.sample_ids] += per_seq.double()
        if info.dp > 1:
            dist.all_reduce(kl_sum, group=info.dp_group)
        kl_sum = kl_sum.cpu()
        rewards = rewards - cfg.kl_coef * kl_sum.float()
        kl_reward_tokens = float(kl_sum.sum())
    adv = ragged_group_advantages(rewards, batch.group_sizes, valid, estimator=estimator, normalize_std=normalize)
    for mb in all_mbs:
        mb.extras["adv"] = adv[mb.sample_ids].to(device)[mb.seq_index]

    if not fused_old:
        s = _policy_stats(all_mbs, info)

    # ---- optimisation
    acc = dict.fromkeys(["loss", "pg_loss", "kl_ref", "entropy", "clip_fraction", "approx_kl", "tis_weight"], 0.0)
    norms: list[float] = []
    n_updates = 0
    for _ in range(cfg.ppo_epochs):
        for mbs, n_tok, n_seq in plan:
            st.optimizer.zero_grad(set_to_none=True)
            part = dict.fromkeys(acc, 0.0)
            for mb in mbs:
                lp, ent = _logprobs(model, mb, st.temperature, True)
                if fused_old:
                    mb.extras["old"] = lp.detach().float()
                m, old, a = mb.loss_mask, mb.extras["old"], mb.extras["adv"]
                w = aggregation_weights(m, mb.seq_index, aggregation, num_tokens=n_tok, num_seqs=n_seq)
                wt = m / max(n_tok, 1.0)  # token-mean weights for metrics
                if kind == "gspo":
                    pg, clipped, log_ratio = gspo_terms(lp, old, a, m, mb.seq_index, clip_low=cfg.clip_low,
                                                        clip_high=cfg.clip_high)
                else:
                    pg, clipped, log_ratio = ppo_clip_terms(lp, old, a, clip_low=cfg.clip_low,
                                                            clip_high=cfg.clip_high, dual_clip=cfg.dual_clip)
                if cfg.tis_cap is not None:
                    tis = torch.where(mb.has_rollout, tis_weights(old, mb.rollout_logprobs, cfg.tis_cap),
                                      torch.ones_like(old))
                    pg = pg * tis
                    part["tis_weight"] += float((tis * wt).sum())
                loss = (pg * w).sum()
                part["pg_loss"] += float(loss.detach())
                if use_ref and not cfg.kl_in_reward:
                    kl = (kl_penalty(lp, mb.extras["ref"], cfg.kl_kind) * w).sum()
                    loss = loss + cfg.kl_coef * kl
                    part["kl_ref"] += float(kl.detach())
                ent_agg = (ent * w).sum()
                if cfg.entropy_coef > 0:
                    loss = loss - cfg.entropy_coef * ent_agg
                part["entropy"] += float((ent.detach() * wt).sum())
                part["clip_fraction"] += float((clipped * wt).sum())
                part["approx_kl"] += float((-log_ratio * wt).sum())
                part["loss"] += float(loss.detach())
                loss.backward()
            allreduce_grads(model, info.dp_group, info.dp, cfg.bucket_mb)
            norm = clip_grad_norm(model, cfg.grad_clip, info.tp_group, info.tp, info.tp_rank)
            if not torch.isfinite(torch.tensor(norm)):
                st.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteGradError(f"gradient norm is {norm} at step {st.step + 1}; optimizer step skipped")
            st.optimizer.step()
            norms.append(norm)
            n_updates += 1
            vals = _dp_sum([part[k] for k in acc], info)
            for k, v in zip(acc, vals):
                acc[k] += v
    if fused_old:
        s = _policy_stats(all_mbs, info)
    st.optimizer.zero_grad(set_to_none=True)
    lr = st.optimizer.param_groups[0]["lr"]
    st.scheduler.step()
    st.step += 1
    dt = time.perf_counter() - t0

    ok = batch.rewards()[0][valid]  # the rollout's rewards, before any KL term
    resp = [s_.response_length for s_ in batch.samples if not s_.failed]
    out = {k: v / max(n_updates, 1) for k, v in acc.items()}
    if cfg.tis_cap is None:
        out.pop("tis_weight")
    if not use_ref:
        out.pop("kl_ref")
    elif cfg.kl_in_reward:  # token-mean KL(old || ref) that went into the rewards
        out["kl_ref"] = kl_reward_tokens / max(s["tok"], 1.0)
    out.update(
        step=st.step, lr=lr, grad_norm=sum(norms) / max(len(norms), 1),
        reward_mean=float(ok.mean()) if ok.numel() else float("nan"),
        reward_std=float(ok.std()) if ok.numel() > 1 else 0.0,
        advantage_abs_mean=float(adv[valid].abs().mean()) if valid.any() else 0.0,
        response_length=sum(resp) / max(len(resp), 1),
        groups=batch.num_groups, samples=len(batch.samples), failed_samples=int((~valid).sum()),
        trained_tokens=s["tok"], tokens=s["tokens"],
        logprob_mean=s["lp_sum"] / max(s["tok"], 1.0),
        logprob_pos_adv=s["pos_lp"] / s["pos_tok"] if s["pos_tok"] else float("nan"),
        step_time_s=dt, tokens_per_s=s["tokens"] * cfg.ppo_epochs / dt if dt > 0 else 0.0,
    )
    if s["r_tok"]:
        out["rollout_logprob_abs_diff"] = s["r_abs"] / s["r_tok"]
        out["rollout_logprob_diff"] = s["r_diff"] / s["r_tok"]
    return out
