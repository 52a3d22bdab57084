"""Optimizer, learning-rate schedule, and gradient reduction/clipping across TP and DP.

Guarantees:
- ``allreduce_grads`` sums gradients over the DP group (the loss is already normalised by
  batch-global counts, so a sum — not a mean — makes DP=N equal DP=1), in flat buckets.
- ``clip_grad_norm`` computes the global L2 norm of the *whole* model: tensor-parallel shards
  (per the model's parameter specs, see ``tp_sharded``) are summed over the TP group, replicated
  parameters are counted once (on TP rank 0). Every rank gets the same norm
  and the same clip factor. A non-finite norm is reported, never applied: the caller skips the step.
- The schedule is linear warmup to ``lr`` over ``warmup_steps``, then constant or cosine decay to
  ``min_lr`` at ``total_steps``; it advances once per training step.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from headrace.shared.config import TrainerConfig


def build_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; no weight decay on biases and norm weights (1-D tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas),
                             eps=1e-8, foreach=False)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule {schedule!r} is not one of constant, cosine")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> LambdaLR:
    """Warmup + constant/cosine schedule (see ``lr_factor``)."""
    min_ratio = min(1.0, cfg.min_lr / cfg.lr) if cfg.lr > 0 else 0.0
    return LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                                                   schedule=cfg.lr_schedule, min_ratio=min_ratio))


def _params_with_grads(model: nn.Module) -> list[nn.Parameter]:
    ps = [p for p in model.parameters() if p.requires_grad]
    for p in ps:
        if p.grad is None:  # ranks without data (or unused params) still join the collectives
            p.grad = torch.zeros_like(p)
    return ps


def allreduce_grads(model: nn.Module, dp_group: dist.ProcessGroup | None, dp: int, bucket_mb: float = 64.0) -> None:
    """Sum gradients over the DP group, bucketing tensors into flat buffers of ~``bucket_mb``."""
    ps = _params_with_grads(model)
    if dp <= 1:
        return
    limit = int(bucket_mb * 2**20)
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=dp_group)
        off = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            off += n
        bucket, size = [], 0

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in ps:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        for g in grads:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= limit:
                flush()
        flush()


def tp_sharded(model: nn.Module) -> set[int]:
    """``id`` of every parameter that is split over TP ranks (the rest are replicated).

    Read from the model's load/export specs (``trainer.model.loading.param_specs``) when it has
    them, else (and for LoRA adapters, ``trainer.lora``) from megatron-core's ``tensor_model_parallel``
    attribute (which megatron only sets when it initialises the weights itself).
    """
    try:
        from headrace.trainer.model.loading import param_specs

        specs = param_specs(model)  # type: ignore[arg-type]
    except Exception:  # not our TPDecoder (tests, other models): fall back to the attribute
        specs = None
    out = set()
    for name, p in model.named_parameters():
        if (specs[name].mode != "rep") if specs is not None and name in specs else getattr(p, "tensor_model_parallel", False):
            out.add(id(p))
    return out


def grad_norm(params: Iterable[nn.Parameter], tp_group: dist.ProcessGroup | None, tp: int, tp_rank: int,
              sharded: set[int] | None = None) -> float:
    """Global L2 norm of the gradients of a TP-sharded model (see the module docstring)."""
    params = list(params)
    sq = torch.zeros((), dtype=torch.float64, device=params[0].device if params else None)
    for p in params:
        if p.grad is None:
            continue
        is_shard = id(p) in sharded if sharded is not None else getattr(p, "tensor_model_parallel", False)
        if is_shard or tp_rank == 0:
            sq += p.grad.detach().to(torch.float64).square().sum()
    if tp > 1:
        dist.all_reduce(sq, group=tp_group)
    return float(sq.sqrt())


def clip_grad_norm(model: nn.Module, max_norm: float, tp_group: dist.ProcessGroup | None, tp: int,
                   tp_rank: int) -> float:
    """Clip gradients to ``max_norm`` (0 disables clipping); returns the norm before clipping."""
    ps = _params_with_grads(model)
    norm = grad_norm(ps, tp_group, tp, tp_rank, tp_sharded(model) if tp > 1 else None)
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in ps:
            p.grad.mul_(scale)
    return norm
