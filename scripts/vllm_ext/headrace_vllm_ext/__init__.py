"""Headrace's vLLM worker extension: weight sync from Headrace's trainer into vLLM 0.32 over our
own torch.distributed update group (gloo on CPU, NCCL on GPU).

Installed into the vLLM venv only (``scripts/build_vllm_venv.sh``) and loaded by vLLM with
``--worker-extension-cls headrace_vllm_ext.WeightSyncExtension``; Headrace's adapter
(``rollout/vllm_weights.py``) calls its methods through vLLM's dev-mode ``/collective_rpc``.
It imports nothing from Headrace: the group is joined exactly as Headrace's
``shared/weight_sync/group.py:join_update_group`` does (a tcp:// rendezvous served by the trainer
at rank 0, the store wrapped in ``PrefixStore(group_name)``, a new non-default group).

Guarantees:
- ``headrace_receive`` receives one bucket (per-tensor broadcasts from rank 0 in ``names`` order,
  or one flat tensor with ``load_format="flattened_bucket"``) into a staging area; the model is
  untouched. A failed receive clears the staging area and raises.
- ``headrace_apply`` loads the staged tensors with vLLM's in-place reload, then handles two vLLM
  CPU bugs: (1) with tied embeddings the CPU backend keeps a pre-packed copy of the output head
  that the reload does not refresh (logits would come from the new body and the old head): the
  head's post-load processing is run again; (2) a load that fails part way leaves unfinished
  layers as meta tensors (the next generation kills the engine): every module's tensors, their
  values and its packed CPU GEMM are snapshotted first and put back on failure, so the engine
  keeps serving the old version and a full re-push recovers. Memory: the staged update plus one
  copy of the model while applying. Returns the staged ``weight_version`` (None: the update was
  incomplete and is discarded).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

log = logging.getLogger("headrace_vllm_ext")


def _join(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
          backend: str, timeout_s: float) -> Any:
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    host = f"[{master_address}]" if ":" in master_address else master_address
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class WeightSyncExtension:
    """Mixed into vLLM's worker class; every method runs in each worker process."""

    _hr_pg: Any = None
    _hr_device: Any = None
    _hr_staged: list[tuple[str, torch.Tensor]] | None = None
    _hr_version: str | None = None

    def headrace_init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            group_name: str, backend: str = "gloo", timeout_s: float = 600.0) -> str:
        if self._hr_pg is not None:
            raise RuntimeError("a Headrace weight-update group is already open")
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._hr_device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        self._hr_pg = _join(master_address, master_port, rank, world_size, group_name, backend, timeout_s)
        return f"rank {rank}"

    def headrace_destroy_group(self) -> None:
        pg, self._hr_pg = self._hr_pg, None
        self._hr_staged = None
        if pg is not None:
            torch.distributed.destroy_process_group(pg)

    def headrace_begin(self) -> None:
        self._hr_staged, self._hr_version = [], None

    def headrace_receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                         load_format: str | None = None, weight_version: str | None = None) -> int:
        if self._hr_pg is None:
            raise RuntimeError("no Headrace weight-update group: /init_weights_update_group first")
        if self._hr_staged is None:
            raise RuntimeError("no weight-update session: /begin_weight_update first")
        try:
            dts = [getattr(torch, d) for d in dtypes]
            if load_format == "flattened_bucket":
                numels = [int(torch.Size(s).numel()) for s in shapes]
                flat = torch.empty(sum(numels), dtype=dts[0], device=self._hr_device)
                torch.distributed.broadcast(flat, src=0, group=self._hr_pg)
                parts = flat.split(numels)
                tensors = [p.view(s) for p, s in zip(parts, shapes)]
            else:
                tensors = []
                for dt, s in zip(dts, shapes):
                    t = torch.empty(s, dtype=dt, device=self._hr_device)
                    torch.distributed.broadcast(t, src=0, group=self._hr_pg)
                    tensors.append(t)
        except BaseException:
            self._hr_staged = None   # a failed bucket poisons the update: the re-push starts over
            raise
        self._hr_staged.extend(zip(names, tensors))
        if weight_version is not None:
            self._hr_version = weight_version
        return len(tensors)

    def headrace_apply(self) -> str | None:
        staged, version = self._hr_staged, self._hr_version
        self._hr_staged, self._hr_version = None, None
        if not staged or version is None:
            return None
        runner = self.model_runner
        model = runner.get_model()
        snapshot = _snapshot(model)
        try:
            runner.reload_weights(weights_iterator=iter(staged))
            _refresh_tied_head(model)
        except BaseException:
            _restore(model, snapshot)
            raise
        return version


def _snapshot(model: torch.nn.Module) -> list[tuple[Any, ...]]:
    """Every module's tensors (objects and values) and its packed CPU GEMM callable."""
    out = []
    for m in model.modules():
        params, buffers = dict(m._parameters), dict(m._buffers)
        values = {k: t.detach().clone() for k, t in {**params, **buffers}.items()
                  if t is not None and not t.is_meta}
        out.append((m, params, buffers, set(m._non_persistent_buffers_set), values,
                    m.__dict__.get("cpu_linear", _MISSING)))
    return out


_MISSING = object()


def _restore(model: torch.nn.Module, snapshot: list[tuple[Any, ...]]) -> None:
    """Put back what ``_snapshot`` saw: no module is left on the meta device, no layer half new."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LOADING_LAYERS, get_layerwise_info
        LOADING_LAYERS.clear()
    except Exception:  # noqa: BLE001 - older layouts: nothing to clear
        get_layerwise_info = None
    for m, params, buffers, non_persistent, values, cpu_linear in snapshot:
        m._parameters.clear()
        m._parameters.update(params)
        m._buffers.clear()
        m._buffers.update(buffers)
        m._non_persistent_buffers_set = non_persistent
        for k, t in {**params, **buffers}.items():
            if k in values:
                t.data.copy_(values[k])
        if cpu_linear is not _MISSING:
            m.cpu_linear = cpu_linear
        if get_layerwise_info is not None:
            try:
                get_layerwise_info(m).reset()
            except Exception:  # noqa: BLE001 - a module without reload info
                pass
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    log.warning("weight update failed: the previous weights are back in place")


def _refresh_tied_head(model: torch.nn.Module) -> None:
    """vLLM CPU bug (1): re-pack the output head when it shares the embedding's weight."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
