"""Per-token log-probabilities and entropy from vocab-sharded logits, without gathering them.

Each TP rank holds logits for a contiguous slice of the vocabulary, ``[T, V_local]`` starting at
``vocab_start``. With z = logits / temperature:

    m      = max_v z_v                      (all-reduce MAX over the TP group)
    S      = sum_v exp(z_v - m)             (all-reduce SUM)
    logZ   = m + log S
    logp_t = z_target - logZ                (z_target picked on the owning rank, all-reduce SUM)
    H      = log S - E_p[z - m]             (sum_v exp(z_v - m) (z_v - m) all-reduced with S)

so the forward costs one MAX and one SUM all-reduce of [T]-sized tensors, never [T, V]. The
backward needs no communication: d logp_t / dz = onehot(target) - p and
dH / dz = -p (z - E_p[z]), both local to the shard (the lm_head's column-parallel backward then
all-reduces the hidden-state gradient). megatron-core's ``vocab_parallel_cross_entropy`` computes
the same log-probability (negated) but overwrites its input in place, reads the global TP group and
has no entropy, so we keep our own; the tests check the two agree.

Precision: bf16/fp16 logits are promoted to fp32; fp32 and fp64 are kept (fp64 makes gradcheck
possible).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: Any,
                inv_temp: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.to(_compute_dtype(logits.dtype)) * inv_temp          # always a new tensor
        n_local = z.shape[-1]
        m = z.max(dim=-1).values if n_local else z.new_full(z.shape[:-1], float("-inf"))
        _all_reduce(m, dist.ReduceOp.MAX, group)
        zs = z - m.unsqueeze(-1)                                        # shifted: better-conditioned sums
        e = torch.exp(zs)
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < n_local)
        idx = local_t.clamp(0, max(n_local - 1, 0)).unsqueeze(-1)
        zt = torch.where(owned, z.gather(-1, idx).squeeze(-1), torch.zeros_like(m)) if n_local else torch.zeros_like(m)
        sums = torch.stack([e.sum(-1), zt, (e * zs).sum(-1) if with_entropy else torch.zeros_like(m)])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        s, zt, ez = sums[0], sums[1], sums[2]
        log_z = m + torch.log(s)
        logp = zt - log_z
        p = e.div_(s.unsqueeze(-1))
        if with_entropy:
            mean_zs = ez / s                                  # E_p[z - m]
            ent = torch.log(s) - mean_zs
            mean_z = m + mean_zs
        else:
            mean_z = ent = torch.zeros(0, dtype=z.dtype, device=z.device)
        ctx.save_for_backward(p, logits if with_entropy else p.new_zeros(0), local_t, owned, mean_z)
        ctx.inv_temp, ctx.with_entropy, ctx.in_dtype = inv_temp, with_entropy, logits.dtype
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):  # type: ignore[override]
        p, logits, local_t, owned, mean_z = ctx.saved_tensors
        grad = torch.zeros_like(p)
        if g_logp is not None:
            grad -= p * g_logp.unsqueeze(-1)
            rows = owned.nonzero(as_tuple=True)[0]
            if rows.numel():
                grad[rows, local_t[rows]] += g_logp[rows].to(grad.dtype)
        if ctx.with_entropy and g_ent is not None and g_ent.numel():
            z = logits.to(p.dtype) * ctx.inv_temp
            grad -= p * (z - mean_z.unsqueeze(-1)) * g_ent.unsqueeze(-1)
        return (grad * ctx.inv_temp).to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                            group: Any = None, temperature: float = 1.0,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [T] and, if asked, the entropy [T] of softmax(logits / temperature).

    ``logits`` [T, V_local] is this rank's vocabulary slice starting at global id ``vocab_start``;
    ``targets`` [T] are global token ids (each owned by exactly one rank of ``group``). A collective
    over ``group``: every TP rank calls it with the same ``targets``. Differentiable in ``logits``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V_local] and targets [T], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp, ent = _VocabParallelLogprob.apply(logits, targets, int(vocab_start), group, 1.0 / float(temperature),
                                            bool(with_entropy))
    return logp, (ent if with_entropy else None)
