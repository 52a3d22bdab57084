"""The ``headrace`` weight-transfer engine for vLLM 0.32: Headrace's trainer broadcasts into vLLM
over Headrace's own torch.distributed update group (gloo on CPU, NCCL on GPU), driven through
vLLM's weight-transfer routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/shutdown_weight_transfer_engine``).

vLLM's worker calls one engine per worker process (``Worker.init_weight_transfer_engine`` and the
rest, through the engine core's collective RPC); the routes pass ``init_info`` and
``update_info`` through as plain dicts, parsed here into ``HeadraceInitInfo`` /
``HeadraceUpdateInfo`` (an unknown or missing key is a ValueError naming it). vLLM's built-in
backends are NCCL-family only; this one is selected with
``--weight-transfer-config '{"backend": "headrace"}'`` and registered by the
``vllm.general_plugins`` entry point ``headrace_vllm_ext:register``.

Guarantees:
- ``init_transfer_engine`` joins the group exactly as Headrace's
  ``shared/weight_sync/group.py:join_update_group`` does (a tcp:// rendezvous served by the
  trainer at rank 0, the store wrapped in ``PrefixStore(group_name)``, a new non-default group);
  this worker's rank is ``rank_offset`` + its rank across vLLM's data-parallel replicas.
- ``update_weights`` receives one bucket (per-tensor broadcasts from rank 0 in ``names`` order, or
  one flat tensor with ``load_format="flattened_bucket"``) into a staging area; the model is not
  touched. A failed receive clears the staging area and raises (vLLM then ends the session).
  ``{"discard": true}`` (no tensors) clears the staging area: the session then ends with nothing
  applied.
- ``finish_weight_update`` loads the staged tensors in one in-place reload, then handles two vLLM
  CPU bugs: (1) with tied embeddings the CPU backend keeps a pre-packed copy of the output head
  that the reload does not refresh (logits would come from the new body and the old head): the
  head's post-load processing runs again; (2) a load that fails part way leaves unfinished layers
  as meta tensors (the next generation kills the engine): every module's tensors, their values and
  its packed CPU GEMM are snapshotted first and put back on failure, so the engine keeps serving
  the old version and a full re-push recovers. An update whose last bucket (the one carrying
  ``weight_version``) never arrived is discarded. Memory: the staged update plus one copy of the
  model while applying.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

log = logging.getLogger("headrace_vllm_ext")
_MISSING = object()


@dataclass
class HeadraceInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine``: the fields of SGLang's
    ``/init_weights_update_group``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if not self.group_name:
            raise ValueError("group_name must not be empty")


@dataclass
class HeadraceUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: one bucket's metadata (vLLM's NCCL field names)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    load_format: str | None = None
    weight_version: str | None = None
    discard: bool = False

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")
        if self.load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format must be null or 'flattened_bucket', got {self.load_format!r}")
        for d in self.dtype_names:
            if not isinstance(getattr(torch, d, None), torch.dtype):
                raise ValueError(f"dtype_names: {d!r} is not a torch dtype")


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float) -> Any:
    """Join as ``shared/weight_sync/group.py:join_update_group`` does (kept in step with it)."""
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


class HeadraceWeightTransferEngine(WeightTransferEngine[HeadraceInitInfo, HeadraceUpdateInfo]):
    """Staged weight updates over Headrace's update group (see the module docstring)."""

    init_info_cls = HeadraceInitInfo
    update_info_cls = HeadraceUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pg: Any = None
        self.recv_device = torch.device("cpu")
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.version: str | None = None

    def init_transfer_engine(self, init_info: HeadraceInitInfo) -> None:
        if self.pg is not None:
            raise RuntimeError("a Headrace weight-update group is already open: shut it down first")
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.recv_device = torch.device("cpu") if init_info.backend == "gloo" else self.device
        self.pg = join_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                             init_info.group_name, init_info.backend, init_info.timeout_s)
        log.info("joined weight-update group %s as rank %d of %d", init_info.group_name, rank, init_info.world_size)

    def shutdown(self) -> None:
        pg, self.pg = self.pg, None
        self.staged, self.version = [], None
        if pg is not None:
            torch.distributed.destroy_process_group(pg)

    def start_weight_update(self) -> None:
        self.staged, self.version = [], None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class would also call torch.accelerator.synchronize(): nothing to wait for here
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: HeadraceUpdateInfo) -> None:
        if update_info.discard:
            self.staged, self.version = [], None
            return
        if self.pg is None:
            raise RuntimeError("no Headrace weight-update group: /init_weight_transfer_engine first")
        try:
            dts = [getattr(torch, d) for d in update_info.dtype_names]
            shapes = update_info.shapes
            if update_info.load_format == "flattened_bucket":
                numels = [int(torch.Size(s).numel()) for s in shapes]
                flat = torch.empty(sum(numels), dtype=dts[0], device=self.recv_device)
                torch.distributed.broadcast(flat, src=0, group=self.pg)
                tensors = [p.view(s) for p, s in zip(flat.split(numels), shapes)]
            else:
                tensors = []
                for dt, s in zip(dts, shapes):
                    t = torch.empty(s, dtype=dt, device=self.recv_device)
                    torch.distributed.broadcast(t, src=0, group=self.pg)
                    tensors.append(t)
        except BaseException:
            self.staged, self.version = [], None   # a failed bucket poisons the update: the re-push starts over
            raise
        self.staged.extend(zip(update_info.names, tensors))
        if update_info.weight_version is not None:
            self.version = update_info.weight_version

    def finish_weight_update(self) -> None:
        staged, version = self.staged, self.version
        self.staged, self.version = [], None
        if not staged or version is None:
            if staged:
                log.warning("weight update without its last bucket: %d tensors discarded", len(staged))
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        snapshot = _snapshot(self.model)
        try:
            initialize_layerwise_reload(self.model)
            self.model.load_weights(iter(staged))
            finalize_layerwise_reload(self.model, self.model_config)
            _refresh_tied_head(self.model)
        except BaseException:
            _restore(self.model, snapshot)
            raise
        log.info("weight version %s applied (%d tensors)", version, len(staged))


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
