"""The RL math of the trainer: advantage estimators, policy losses, KL and entropy terms.

Every function here is pure (tensors in, tensors out, no state, no distributed calls) so users and
custom-loss plugins build on them. Conventions follow verl's ``trainer/ppo/core_algos.py`` so that
figures compare with published runs:

- group std is torch's *unbiased* std, ``eps = 1e-6`` added to the std (not the variance);
- a group of one sample has mean 0 and std 1 (its advantage is its reward);
- ``log_ratio`` is clamped to [-20, 20] before ``exp``;
- ``token_mean`` aggregation averages over all unmasked tokens of the batch (not per sequence first).

Two layouts: the public ``policy_loss`` / ``kl_penalty`` take padded ``[B, T]`` tensors (DESIGN.md);
the trainer works on *packed* sequences (``[N]`` tokens of many sequences with a ``seq_index`` per
token, see ``trainer.batch``) and calls the ``*_terms`` functions plus ``aggregation_weights``, which
turn any aggregation into a weighted sum ``sum(per_token * weight)``. A weighted sum is linear, so a
batch split into micro-batches and data-parallel ranks gives the same loss and gradient as the
whole batch, provided the weights are computed with the batch-global token / sequence counts.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
KL_KINDS = ("k1", "k2", "k3")


# ---- advantages ------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, group_size: int, *, estimator: str = "grpo",
                     normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Outcome advantages for rewards laid out group by group: ``rewards [B]`` -> ``[B]``.

    - ``"grpo"`` — GRPO (Shao et al. 2024, *DeepSeekMath*, arXiv:2402.03300, eq. 3 outcome
      supervision): ``(r - mean_g) / (std_g + eps)``; with ``normalize_std=False`` only mean-centred,
      which is Dr. GRPO (Liu et al. 2025, *Understanding R1-Zero-Like Training*, arXiv:2503.20783).
    - ``"rloo"`` — REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al.
      2019): ``r_i - mean_{j != i} r_j`` = ``n/(n-1) * (r_i - mean_g)``.
    - ``"reinforce_pp"`` — REINFORCE++ (Hu 2025, arXiv:2501.03262): no per-prompt baseline; the
      rewards are normalised over the whole batch, ``(r - mean_B) / (std_B + eps)`` (``group_size``
      is then only checked). verl whitens per token (each sample weighted by its length); this
      function weights samples equally — the difference vanishes for equal response lengths.

    A group of one sample keeps its reward (verl: mean 0, std 1).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of length {rewards.numel()} do not split into groups of {group_size}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator {estimator!r} is not one of {ESTIMATORS}")
    r = rewards.to(torch.float32)
    if estimator == "reinforce_pp":
        if r.numel() < 2:
            return torch.zeros_like(r)
        centred = r - r.mean()
        return centred / (r.std() + eps) if normalize_std else centred
    g = r.view(-1, group_size)
    if group_size == 1:
        return r.clone()
    mean = g.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        n = group_size
        return ((g - mean) * (n / (n - 1))).reshape(-1)
    centred = g - mean
    if normalize_std:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def ragged_group_advantages(rewards: Tensor, group_sizes: Sequence[int], valid: Tensor | None = None, *,
                            estimator: str = "grpo", normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """``group_advantages`` for groups of different sizes (after dynamic sampling) and failed samples.

    ``rewards [B]`` group by group with ``sum(group_sizes) == B``; ``valid [B]`` bool marks samples
    with a reward. Invalid (failed) samples take no part in their group's statistics and get
    advantage 0 — the trainer also gives them loss mask 0, so they contribute nothing to the loss.
    """
    if sum(group_sizes) != rewards.numel():
        raise ValueError(f"group sizes sum to {sum(group_sizes)} but there are {rewards.numel()} rewards")
    r = rewards.to(torch.float32)
    valid = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    out = torch.zeros_like(r)
    if estimator == "reinforce_pp":
        if valid.any():
            out[valid] = group_advantages(r[valid], int(valid.sum()), estimator=estimator,
                                          normalize_std=normalize_std, eps=eps)
        return out
    start = 0
    for n in group_sizes:
        sl = slice(start, start + n)
        v = valid[sl]
        k = int(v.sum())
        if k:
            idx = torch.nonzero(v).flatten() + start
            out[idx] = group_advantages(r[idx], k, estimator=estimator, normalize_std=normalize_std, eps=eps)
        start += n
    return out


# ---- aggregation -----------------------------------------------------------------------------


def aggregation_weights(mask: Tensor, seq_index: Tensor, aggregation: str, *,
                        num_tokens: float, num_seqs: float, seq_lengths: Tensor | None = None) -> Tensor:
    """Per-token weights ``w`` such that ``sum(per_token * w)`` is the requested aggregation.

    ``mask [N]`` (0/1), ``seq_index [N]`` (which sequence each token belongs to). ``num_tokens`` and
    ``num_seqs`` are the counts over the *whole batch* (all micro-batches and DP ranks):
    - ``token_mean``: ``mask / num_tokens``;
    - ``seq_mean_token_mean``: ``mask / (len_s * num_seqs)`` with ``len_s`` the sequence's unmasked tokens;
    - ``seq_mean_token_sum``: ``mask / num_seqs`` (Dr. GRPO divides by a constant instead; scale the
      learning rate for that).
    ``seq_lengths [S]`` (unmasked tokens per sequence) may be given, else it is counted from ``mask``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r} is not one of {AGGREGATIONS}")
    mask = mask.to(torch.float32)
    if aggregation == "token_mean":
        return mask / max(float(num_tokens), 1.0)
    if aggregation == "seq_mean_token_sum":
        return mask / max(float(num_seqs), 1.0)
    if seq_lengths is None:
        n = int(seq_index.max()) + 1 if seq_index.numel() else 0
        seq_lengths = torch.zeros(n, dtype=torch.float32, device=mask.device).index_add_(0, seq_index, mask)
    per_tok_len = seq_lengths.to(torch.float32)[seq_index].clamp(min=1.0)
    return mask / (per_tok_len * max(float(num_seqs), 1.0))


def aggregate(values: Tensor, mask: Tensor, aggregation: str = "token_mean") -> Tensor:
    """Aggregate per-token ``values [B, T]`` under ``mask [B, T]``; sequences with no token are not counted."""
    seq_index = torch.arange(values.shape[0], device=values.device).unsqueeze(1).expand_as(values).reshape(-1)
    m = mask.reshape(-1).to(torch.float32)
    num_seqs = float((mask.reshape(values.shape[0], -1).sum(-1) > 0).sum())
    w = aggregation_weights(m, seq_index, aggregation, num_tokens=float(m.sum()), num_seqs=num_seqs)
    return (values.reshape(-1) * w).sum()


# ---- policy loss -----------------------------------------------------------------------------


def ppo_clip_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, clip_low: float = 0.2,
                   clip_high: float = 0.2, dual_clip: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO-clip loss (Schulman et al. 2017, arXiv:1707.06347, eq. 7), any shape.

    ``ratio = exp(logprobs - old_logprobs)``; loss ``max(-A*ratio, -A*clip(ratio, 1-clip_low, 1+clip_high))``.
    Separate ``clip_low`` / ``clip_high`` is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476).
    ``dual_clip = c > 1`` bounds the loss of negative-advantage tokens by ``-A*c`` (Ye et al. 2020,
    *Mastering Complex Control in MOBA Games*, arXiv:1912.09729). Returns ``(loss, clipped, log_ratio)``
    where ``clipped`` is 1.0 where a clip bound is active (the clip-fraction numerator).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(l1, l2)
    clipped = (l2 > l1)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        l3 = -advantages * dual_clip
        neg = advantages < 0
        clipped = clipped | (neg & (loss > l3))
        loss = torch.where(neg, torch.minimum(loss, l3), loss)
    return loss, clipped.to(torch.float32), log_ratio.detach()


def gspo_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, seq_index: Tensor, *,
               clip_low: float = 3e-4, clip_high: float = 4e-4, seq_lengths: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token GSPO loss with sequence-level ratios (Zheng et al. 2025, arXiv:2507.18071, GSPO-token).

    ``s_i = exp(mean_t (logprobs - old_logprobs))`` over the unmasked tokens of sequence i; each token
    carries ``sg[s_i] * exp(logprobs_t - sg[logprobs_t])`` (value ``s_i``, gradient that of
    ``s_i`` for sequence-level advantages). Loss ``max(-A*s, -A*clip(s, 1-clip_low, 1+clip_high))``;
    aggregate it with ``seq_mean_token_mean`` as the paper (and verl) do. Flat ``[N]`` tensors.
    Returns ``(loss, clipped, seq_log_ratio per token)``.
    """
    m = mask.to(torch.float32)
    if seq_lengths is None:
        n = int(seq_index.max()) + 1 if seq_index.numel() else 0
        seq_lengths = torch.zeros(n, dtype=torch.float32, device=m.device).index_add_(0, seq_index, m)
    diff = (logprobs - old_logprobs).detach() * m
    n_seq = seq_lengths.numel()
    seq_lr = torch.zeros(n_seq, dtype=diff.dtype, device=diff.device).index_add_(0, seq_index, diff)
    seq_lr = seq_lr / seq_lengths.to(diff.dtype).clamp(min=1.0)
    log_s = (logprobs - logprobs.detach() + seq_lr[seq_index]).clamp(max=10.0)
    s = torch.exp(log_s)
    l1 = -advantages * s
    l2 = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(l1, l2), (l2 > l1).to(torch.float32), seq_lr[seq_index]


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                aggregation: str = "token_mean") -> tuple[Tensor, dict[str, float]]:
    """PPO-clip policy loss on padded ``[B, T]`` tensors (see ``ppo_clip_terms`` for the formula).

    ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``. Returns the aggregated loss and
    metrics ``clip_fraction`` (token-mean of active clips) and ``approx_kl`` (token-mean of
    ``old_logprobs - logprobs``, verl's ``ppo_kl``).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"shapes differ: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)}, mask {tuple(mask.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    loss, clipped, log_ratio = ppo_clip_terms(logprobs, old_logprobs, advantages, clip_low=clip_low,
                                              clip_high=clip_high, dual_clip=dual_clip)
    m = mask.to(torch.float32)
    n = m.sum().clamp(min=1.0)
    metrics = {"clip_fraction": float((clipped * m).sum() / n), "approx_kl": float((-log_ratio * m).sum() / n)}
    return aggregate(loss, m, aggregation), metrics


# ---- KL, entropy, importance sampling ---------------------------------------------------------


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, *Approximating KL
    Divergence*, http://joschu.net/blog/kl-approx.html), with ``log_r = ref_logprobs - logprobs``:

    - ``k1 = -log_r`` (unbiased, high variance; verl "kl");
    - ``k2 = 0.5 * log_r**2`` (verl "mse");
    - ``k3 = exp(log_r) - log_r - 1`` (unbiased, >= 0, low variance; verl "low_var_kl", as in
      GRPO's eq. 4), with ``log_r`` clamped to [-20, 20] and the result to [-10, 10] like verl.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind {kind!r} is not one of {KL_KINDS}")
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    log_r = (-diff).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(exp(old - rollout), cap)`` (detached).

    Corrects for the rollout engine's distribution differing from the trainer's (Yao et al. 2025,
    *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*; the IMPALA/V-trace
    truncation of Espeholt et al. 2018, arXiv:1802.01561). Multiplies the per-token policy loss.
    """
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    return torch.exp((old_logprobs - rollout_logprobs).detach().clamp(-20.0, 20.0)).clamp(max=cap)


def entropy_bonus(entropy: Tensor, mask: Tensor, aggregation: str = "token_mean") -> Tensor:
    """Aggregated policy entropy (Williams & Peng 1991; Mnih et al. 2016, arXiv:1602.01783).

    The trainer *subtracts* ``entropy_coef * entropy_bonus`` from the loss, favouring exploration.
    """
    return aggregate(entropy, mask, aggregation)
