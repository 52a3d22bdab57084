"""Rank 0's side of the buffer: lease a step's groups, validate them, ack or release the lease.

Why rank 0 leases for everyone and broadcasts the batch (instead of each DP rank leasing its share):
one lease per step means one ack or one release — a step is consumed or returned whole, never
half; validation happens once, so every rank agrees whether a batch is bad and nobody blocks in a
collective; and advantages and loss normalisers need the whole batch's rewards and token counts,
which every rank then has without extra communication. The batch is token ids and a few floats per
token: broadcasting it costs little next to a training step. ``trainer.batch`` then gives each DP
rank a token-balanced share.

Guarantees:
- A bad batch (``BadBatchError``: token outside the vocabulary, prompts that differ within a
  group, non-finite reward, no trainable token, ...) is released, not acked, before ``next`` raises
  the error (naming the group) on every rank.
- ``release_on_failure`` releases the lease when anything in its block raises, then lets the error
  propagate; only ``ack`` consumes it.
- Train-only mode (no rollout URL): ``next`` returns None when fewer than ``groups_per_step``
  groups arrive within ``lease_wait_s``. With a rollout URL it waits.
- A SIGTERM (``StopRequest``) is noticed by a rank 0 waiting for groups within ``STOP_POLL_S``;
  ``next`` then returns None on every rank.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from headrace.shared.config import HeadraceConfig
from headrace.shared.staleness import lease_floor
from headrace.trainer.batch import BadBatchError, TrainBatch, build_batch

log = logging.getLogger("headrace.trainer")

STOP_POLL_S = 2.0  # longest single lease wait, so a stop request is seen this quickly


class StopRequest:
    """Set by SIGTERM (in the main thread's handler); ranks agree on it at step boundaries."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.requested:
            log.warning("SIGTERM: stopping after the current step (a checkpoint of it will be written)")
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (one tiny all-reduce per step)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


@dataclass
class Leased:
    lease_id: str | None
    batch: TrainBatch
    weight_version: int    # the oldest policy version that generated a group of the batch
    wait_s: float          # how long rank 0 waited for the groups


class LeaseSource:
    """Rank 0 leases and validates; every rank gets the same ``Leased``, None (stop) or the error."""

    def __init__(self, cfg: HeadraceConfig, buffer_url: str, rollout_url: str | None, rank: int,
                 vocab_size: int, max_seq_len: int, stop: StopRequest | None = None) -> None:
        self.cfg, self.rank, self.train_only = cfg, rank, rollout_url is None
        self.stop = stop or StopRequest()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.client = None
        self.min_version = 0      # leases take no group older than policy_version - max_staleness
        if rank == 0:
            from headrace.shared.client import BufferClient

            self.client = BufferClient(buffer_url, token=cfg.buffer.token)

    def _lease_rank0(self) -> dict[str, Any]:
        n = self.cfg.rollout.groups_per_step
        wait_s = self.cfg.trainer.lease_wait_s
        t0 = time.perf_counter()
        attempt = t0
        while True:
            if self.stop.requested:
                return {"kind": "stop", "reason": "stop requested (SIGTERM) while waiting for groups"}
            lease = self.client.lease(n, wait_s=min(STOP_POLL_S, max(0.05, attempt + wait_s - time.perf_counter())),
                                      lease_s=self.cfg.buffer.lease_s, min_weight_version=self.min_version or None)
            if lease is not None:
                break
            if time.perf_counter() - attempt < wait_s:
                continue
            attempt = time.perf_counter()
            if self.train_only:
                st = self.client.stats()
                return {"kind": "stop", "reason": f"train-only mode: the buffer did not hold {n} groups "
                                                  f"within {self.cfg.trainer.lease_wait_s}s (queued {st.queued}, "
                                                  f"leased {st.leased}, consumed {st.consumed})"}
            log.info("waiting for %d groups in the buffer", n)
        wait = time.perf_counter() - t0
        try:
            batch = build_batch(lease.groups, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)
        except BadBatchError as e:
            self.client.release(lease.lease_id)
            return {"kind": "error", "group_id": e.group_id, "problem": e.problem, "lease_id": lease.lease_id}
        wv = min(g.weight_version for g in lease.groups)
        return {"kind": "batch", "leased": Leased(lease.lease_id, batch, wv, wait)}

    def next(self) -> Leased | None:
        """The next batch on every rank; raises ``BadBatchError`` on every rank for a bad one."""
        msg = [self._lease_rank0() if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(msg, src=0)
        m = msg[0]
        if m["kind"] == "stop":
            log.info(m["reason"])
            return None
        if m["kind"] == "error":
            raise BadBatchError(m["group_id"], m["problem"] + f" (lease {m['lease_id']} released, not acked)")
        return m["leased"]

    @contextmanager
    def release_on_failure(self, leased: Leased) -> Iterator[None]:
        """Release the lease (rank 0) if the block raises; the error propagates unchanged."""
        try:
            yield
        except BaseException:
            try:
                self._finish(leased, ok=False)
            except Exception as e:  # the buffer is unreachable too: report, don't mask the original
                log.warning("releasing lease %s after a failed step failed: %s", leased.lease_id, e)
            raise

    def ack(self, leased: Leased) -> None:
        """The step's groups are consumed (rank 0)."""
        self._finish(leased, ok=True)

    def _finish(self, leased: Leased, ok: bool) -> None:
        if self.client is None or leased.lease_id is None:
            return
        (self.client.ack if ok else self.client.release)(leased.lease_id)

    def set_policy_version(self, v: int) -> None:
        """Tell the buffer (rank 0) the trainer's policy version; later leases skip groups too stale for it."""
        self.min_version = lease_floor(v, self.cfg.buffer.max_staleness)
        if self.client is not None:
            self.client.set_policy_version(v)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
