"""Weight sync, engine side, one rank's transport: join the trainer's weight-update group and
receive broadcast tensors. The session rules around it (begin, bucket, end, destroy) are
``rollout.engine.session``; this module knows nothing of HTTP.

``WeightReceiver`` joins the group as rank ``rank_offset + tp_rank`` exactly as SGLang's
``init_custom_process_group`` does (``shared.weight_sync.group.join_update_group``: tcp:// rendezvous
served by rank 0, ``PrefixStore(group_name)``, a new non-default group) and receives either one
broadcast per tensor from rank 0 in ``names`` order, or one flat tensor
(``load_format="flattened_bucket"``: the tensors flattened and concatenated in ``names`` order,
all of one dtype). Tensors land in a receive buffer kept per dtype while the group lives (the
returned views are valid until the next receive) or, per tensor, straight into the engine's own
weights when a ``dest`` lookup is given (per tensor, or a whole flattened bucket when the engine's
tensors for it are one contiguous range). Every call blocks; HTTP handlers run them in a worker
thread.

A receive can be given up: gloo does not always notice that rank 0 died in the middle of a
broadcast (measured: 3 of 8 SIGKILLs of a sender looping over 4 MB broadcasts left the receiver
blocked until the group timeout), so with ``cancelled`` a gloo receive waits in slices of
``WAIT_SLICE_S`` and raises ``ReceiveCancelled`` once ``cancelled()`` is true. The group must then
be destroyed (its pending receive is abandoned with it); a new group works normally.
"""

from __future__ import annotations

import datetime
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from headrace.shared.weight_sync.buckets import contiguous_run, parse_dtype, unflatten_bucket
from headrace.shared.weight_sync.group import destroy_update_group, join_update_group
from headrace.shared.weight_sync.protocol import FLATTENED

__all__ = ["WeightReceiver", "ReceiveCancelled", "WAIT_SLICE_S"]

WAIT_SLICE_S = 0.5   # how often a gloo receive checks whether it was given up


class ReceiveCancelled(RuntimeError):
    """A receive given up (``cancelled()`` became true) before rank 0's data arrived."""


class WeightReceiver:
    """One engine rank's membership in the weight-update group."""

    def __init__(self, device: str | torch.device = "cpu", tp_rank: int = 0) -> None:
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.group_name: str | None = None
        self._pg: dist.ProcessGroup | None = None
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        """Join as rank ``rank_offset + tp_rank``; blocks until all ranks joined (or timeout)."""
        if self._pg is not None:
            raise RuntimeError(f"already in weight-update group {self.group_name!r}; destroy it first")
        if rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {rank_offset}")
        self._pg = join_update_group(master_address, int(master_port), rank_offset + self.tp_rank,
                                     int(world_size), group_name, backend, timeout_s)
        self.group_name = group_name

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                load_format: str | None = None,
                dest: Callable[[str], torch.Tensor | None] | None = None,
                cancelled: Callable[[], bool] | None = None) -> list[tuple[str, torch.Tensor]]:
        """Receive the tensors rank 0 broadcasts for this request, in ``names`` order. They come
        back as views of a receive buffer (one per dtype) that the next call reuses: copy them (as
        ``load_weights`` does) before receiving again.

        ``dest``: ``dest(name)`` may return the engine's own tensor for that name. Per tensor: when
        it is contiguous with the announced dtype, shape and device the tensor is received straight
        into it. Flattened: when the bucket's tensors are back to back in one storage in ``names``
        order, the whole bucket is received straight into that range. Either way there is no load
        copy: the returned pair holds that very tensor, so a loader can skip it by ``data_ptr``.
        Only inside an update session: a failed receive then leaves those weights partially
        written, like any failed update.

        ``cancelled``: polled while a gloo receive waits (module docstring); ``ReceiveCancelled``."""
        if self._pg is None:
            raise RuntimeError("not in a weight-update group: call init_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        if not names:
            raise ValueError("names is empty")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        for name, shape in zip(names, shapes):
            if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"{name}: shape must be a list of ints >= 0, got {shape!r}")
        if load_format == FLATTENED:
            if len(set(torch_dtypes)) != 1:
                raise ValueError(f"a flattened bucket holds one dtype, got {sorted(set(map(str, dtypes)))}")
            total = sum(_numel(s) for s in shapes)
            region = self._own_range(names, torch_dtypes[0], shapes, dest) if dest is not None else None
            if region is not None:
                self._wait([dist.broadcast(region[0], src=0, group=self._pg, async_op=True)], cancelled)
                return region[1]
            flat = self._buffer(torch_dtypes[0], total)
            self._wait([dist.broadcast(flat, src=0, group=self._pg, async_op=True)], cancelled)
            return unflatten_bucket(flat, names, shapes)
        if load_format not in (None, "auto"):
            raise ValueError(f"unsupported load_format {load_format!r} (None or {FLATTENED!r})")
        totals: dict[torch.dtype, int] = {}
        for d, shape in zip(torch_dtypes, shapes):
            totals[d] = totals.get(d, 0) + _numel(shape)
        flats = {d: self._buffer(d, n) for d, n in totals.items()}
        offsets = dict.fromkeys(totals, 0)
        out = []
        for name, d, shape in zip(names, torch_dtypes, shapes):
            n = _numel(shape)
            own = dest(name) if dest is not None else None
            if (own is not None and own.dtype == d and list(own.shape) == list(shape) and own.is_contiguous()
                    and own.device == self.device):
                out.append((name, own))
                continue
            out.append((name, flats[d][offsets[d]:offsets[d] + n].view(*shape)))
            offsets[d] += n
        self._wait([dist.broadcast(t, src=0, group=self._pg, async_op=True) for _, t in out], cancelled)
        return out

    def _wait(self, works: list[dist.Work], cancelled: Callable[[], bool] | None) -> None:
        """Wait for every broadcast; on gloo with ``cancelled``, in slices, giving up when it is true.
        (NCCL work is waited plainly: its hangs are the communicator's watchdog's to end.)"""
        sliced = cancelled is not None and dist.get_backend(self._pg) == "gloo"
        for w in works:
            if not sliced:
                w.wait()
                continue
            while True:
                try:
                    w.wait(timeout=datetime.timedelta(seconds=WAIT_SLICE_S))
                    break
                except RuntimeError as e:
                    if "timed out" not in str(e):
                        raise
                    if cancelled():
                        raise ReceiveCancelled(f"receive from group {self.group_name!r} given up: rank 0 did "
                                               "not send (a sender that died or left the group)") from None

    def _own_range(self, names: Sequence[str], dtype: torch.dtype, shapes: Sequence[Sequence[int]],
                   dest: Callable[[str], torch.Tensor | None]) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]] | None:
        """When the engine's own tensors for ``names`` lie back to back in one storage, in that order,
        with the announced dtype and shapes (the reference engine lays its weights out in the
        trainer's order), the flat 1-D view of that range and the (name, own tensor) pairs: the
        bucket is then received straight into the weights. None otherwise (received into a buffer)."""
        own = []
        for name, shape in zip(names, shapes):
            t = dest(name)
            if t is None or t.dtype != dtype or list(t.shape) != list(shape) or t.device != self.device:
                return None
            own.append((name, t))
        run = contiguous_run([t for _, t in own])
        return None if run is None else (run, own)

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The front of a receive buffer kept per dtype (grown as needed), so a many-bucket update
        does not fault in fresh pages for every bucket."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def release_buffers(self) -> None:
        """Free the receive buffers (they are also freed by destroy())."""
        self._buffers.clear()

    def destroy(self) -> None:
        """Leave and destroy the group (no-op when not in one)."""
        self._buffers.clear()
        pg, self._pg = self._pg, None
        self.group_name = None
        destroy_update_group(pg)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
