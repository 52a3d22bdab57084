"""The weight-update process group, joined the same way by trainer rank 0 and every engine rank.

Both sides join as SGLang's ``init_custom_process_group`` does: a ``tcp://master_address:master_port``
rendezvous whose store is served by rank 0, wrapped in ``PrefixStore(group_name)``, and a new
process group that is not the default group. A plain ``init_process_group`` on the trainer side
would not meet the engines.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["join_update_group", "destroy_update_group"]


def join_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, backend: str = "gloo", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Join the weight-update group: a tcp:// rendezvous (rank 0 serves the store), the store
    wrapped in ``PrefixStore(group_name)``, a new non-default group of ``world_size`` ranks.
    Blocks until every rank joined or ``timeout_s``."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)
    if not group_name:
        raise ValueError("group_name must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    host = f"[{master_address}]" if ":" in master_address else master_address
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_update_group(pg: dist.ProcessGroup | None) -> None:
    """Destroy a group made by join_update_group (no-op for None)."""
    if pg is not None:
        dist.destroy_process_group(pg)
