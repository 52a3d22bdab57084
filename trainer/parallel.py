"""Process groups of the trainer: tensor parallel (TP) inside a group, data parallel (DP) across.

``init_distributed`` reads the torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, optionally LOCAL_RANK), creates the default group (gloo on CPU, NCCL when CUDA is
available) and lets megatron-core's ``parallel_state`` carve it into TP and DP groups, so the layout
is Megatron's: TP groups are blocks of consecutive ranks ([0,1], [2,3] at TP=2), DP groups stride
across them ([0,2], [1,3]). Every rank of a TP group holds a different shard of the same model;
every rank of a DP group holds the same shard.

Guarantees: ``world_size == tp * dp`` or a ValueError naming both; the returned ``ParallelInfo``
carries the two groups so model code never consults globals; ``destroy_distributed`` undoes
everything (safe to call twice).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _import_megatron() -> Any:
    """``megatron.core.parallel_state``, megatron-core imported with ``torch.compile`` as a no-op.

    Importing megatron.core runs every module of the package, and megatron decorates its fused
    kernels (bias-GeLU / SwiGLU / GeGLU, cross-entropy, MoE routing) with ``torch.compile``, whose
    first call imports dynamo and inductor: ~1.7 s of CPU at each trainer start on the 2-core
    machine (megatron's import 2.9 s -> 1.2 s). This trainer calls none of those kernels (its
    decoder is its own: megatron's tensor-parallel layers and mappings only), so they stay eager.
    ``torch.compile`` itself is restored before this returns. The first import of megatron in the
    process decides, so every trainer module reaches megatron through this module.
    """
    import sys

    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state as ps
        return ps
    compile_ = torch.compile

    def eager(model: Any = None, **_: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    torch.compile = eager
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected on CPU
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as ps
    finally:
        torch.compile = compile_
    return ps


parallel_state = _import_megatron()


@dataclass
class ParallelInfo:
    """Where this process sits: global rank, TP/DP sizes and ranks, and the two process groups."""

    rank: int
    world_size: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: Any   # torch.distributed.ProcessGroup
    dp_group: Any   # torch.distributed.ProcessGroup
    device: torch.device = torch.device("cpu")

    @property
    def is_tp_leader(self) -> bool:
        """True on TP rank 0 (the rank that yields gathered HF tensors)."""
        return self.tp_rank == 0


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set (launch with torchrun or trainer.launch.spawn)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def init_distributed(tp: int, dp: int = 1, backend: str | None = None, timeout_s: float = 600.0) -> ParallelInfo:
    """Join the job described by the environment and build Megatron's TP/DP groups.

    ``backend`` defaults to "nccl" when CUDA is available, else "gloo". With NCCL the process binds
    to cuda:LOCAL_RANK. Single-process runs (RANK/WORLD_SIZE unset, tp == dp == 1) get a private
    loopback rendezvous so callers need not set anything.
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"tp={tp} and dp={dp} must both be >= 1")
    if "RANK" not in os.environ and tp * dp == 1:
        from headrace.shared.procs import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world != tp * dp:
        raise ValueError(f"WORLD_SIZE={world} but tp*dp = {tp}*{dp} = {tp * dp}; they must be equal")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        local = _env_int("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # gloo DP groups are only needed by megatron's distributed optimizer; on CPU the default
    # group is gloo already, so skip the duplicates.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=backend != "gloo")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    return ParallelInfo(rank=rank, world_size=world, tp=tp, dp=dp,
                        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                        dp_rank=parallel_state.get_data_parallel_rank(),
                        tp_group=tp_group, dp_group=dp_group, device=device)


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default group (no-op when not initialised)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
