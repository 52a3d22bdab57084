"""Rank 0's side of the buffer: lease a step's groups, validate them, reject the bad ones, hold the
trained leases until a checkpoint covers them, then ack them.

Why rank 0 leases for everyone and broadcasts the batch (instead of each DP rank leasing its share):
one lease per step means one ack or one release — a step is consumed or returned whole, never
half; validation happens once, so every rank agrees whether a batch is bad and nobody blocks in a
collective; and advantages and loss normalisers need the whole batch's rewards and token counts,
which every rank then has without extra communication. The batch is token ids and a few floats per
token: broadcasting it costs little next to a training step. ``trainer.batch`` then gives each DP
rank a token-balanced share. Leases arrive as columns (``BufferClient.lease_columns``, validated with
numpy on arrival) and become the batch's arrays directly (``trainer.batch_columns``): no Python
object per token on the way from the buffer to the packed tensors.

Guarantees (DESIGN.md "Exactly-once consumption"):
- A group is acked only once a durable checkpoint contains the update it went into: ``hold``
  marks a trained step's lease held (``extend`` with ``trained: true``); ``ack_held`` acks every
  held lease, and is called only after ``Checkpointer.save`` wrote. Until then ``LeaseKeeper``
  extends them. After a kill -9 of the trainer they expire and their groups are trained again by
  the resumed trainer (from the last checkpoint, which does not contain them).
- A bad batch (``BadBatchError``: token outside the vocabulary, prompts that differ within a
  group, non-finite reward, no trainable token, ...) is never trained: its bad groups are rejected
  (``POST /v1/leases/{id}/reject`` with the reason: dead-lettered, the lease's other groups back
  at the head of the queue), the reason is logged and ``next`` leases again. ``next`` raises the
  error on every rank only when the groups rejected exceed ``trainer.max_rejected_fraction`` of
  the groups leased, counting at least a whole run (``trainer.steps x groups_per_step``) so that
  one poison group early in a run does not stop it (counts are per trainer process).
- ``release_on_failure`` releases the step's lease when anything in its block raises, then lets
  the error propagate; ``release_held`` returns held leases whose training will not be saved.
- Buffer outages: every call is retried (``trainer.buffer_link.retrying``: logged, bounded by
  ``BUFFER_OUTAGE_S``); an ack, extend or reject answered 409/404 (the lease expired, e.g. a
  buffer restart took longer than ``buffer.lease_s``) is logged, not fatal: those groups are back
  in the queue and will be trained again.
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
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from headrace.shared.client import BufferError
from headrace.shared.config import HeadraceConfig
from headrace.shared.staleness import lease_floor
from headrace.trainer.batch import BadBatchError, TrainBatch, build_batch
from headrace.trainer.batch_columns import build_batch_columns
from headrace.trainer.buffer_link import LeaseKeeper, expired, retrying

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


class StopInterrupt(Exception):
    """A SIGTERM that ended a wait on others (a weight sync) instead of letting the step finish."""


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
        self.client: Any = None
        self.keeper: LeaseKeeper | None = None
        self.min_version = 0      # leases take no group older than policy_version - max_staleness
        self.held: list[Leased] = []             # trained, not yet in a checkpoint (rank 0)
        self.on_wait: Callable[[], None] | None = None   # rank 0, each lease_wait_s spent waiting for groups
        self.groups_leased = self.groups_rejected = self.groups_acked = self.groups_replayed = 0
        if rank == 0:
            from headrace.shared.client import BufferClient

            self.client = BufferClient(buffer_url, token=cfg.auth.token, retries=0)   # retried here, logged
            self.keeper = LeaseKeeper(buffer_url, cfg.auth.token, cfg.buffer.lease_s)

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return retrying(what, getattr(self.client, method), *args, stopping=lambda: self.stop.requested, **kwargs)

    def _lease_rank0(self) -> dict[str, Any]:
        n = self.cfg.rollout.groups_per_step
        wait_s = self.cfg.trainer.lease_wait_s
        t0 = time.perf_counter()
        attempt = t0
        while True:
            if self.stop.requested:
                return {"kind": "stop", "reason": "stop requested (SIGTERM) while waiting for groups"}
            lease = self._call("lease", self._lease_method, n, lease_s=self.cfg.buffer.lease_s,
                               wait_s=min(STOP_POLL_S, max(0.05, attempt + wait_s - time.perf_counter())),
                               min_weight_version=self.min_version or None)
            if lease is None:
                if time.perf_counter() - attempt < wait_s:
                    continue
                attempt = time.perf_counter()
                if self.train_only:
                    st = self._call("stats", "stats")
                    return {"kind": "stop", "reason": f"train-only mode: the buffer did not hold {n} groups "
                                                      f"within {self.cfg.trainer.lease_wait_s}s (queued {st.queued}, "
                                                      f"leased {st.leased}, consumed {st.consumed})"}
                log.info("waiting for %d groups in the buffer", n)
                if self.on_wait is not None:
                    self.on_wait()
                continue
            try:
                batch = self._batch(lease)
            except BadBatchError as e:
                stop = self._reject(lease.lease_id, e)
                if stop is not None:
                    return stop
                attempt = time.perf_counter()   # the rest of the lease is back at the head of the queue
                continue
            if self.keeper is not None:
                self.keeper.track(lease.lease_id, trained=False)
            wv = int(batch.weight_version.min())   # a group's version is the minimum over its samples
            return {"kind": "batch", "leased": Leased(lease.lease_id, batch, wv, time.perf_counter() - t0)}

    @property
    def _lease_method(self) -> str:
        """Columns (``BufferClient.lease_columns``), or rows from a client without them (a test double)."""
        return "lease_columns" if hasattr(self.client, "lease_columns") else "lease"

    def _batch(self, lease: Any) -> TrainBatch:
        """The lease's groups as a validated batch; counts them as leased first (``BadBatchError``)."""
        cols = getattr(lease, "columns", None)
        self.groups_leased += len(lease.groups) if cols is None else cols.num_groups
        if cols is None:
            return build_batch(lease.groups, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)
        return build_batch_columns(cols, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)

    def _reject(self, lease_id: str, e: BadBatchError) -> dict[str, Any] | None:
        """Dead-letter the bad groups of a lease (the rest go back to the queue); the error message
        for every rank when too many were rejected (or the error names no group), else None."""
        if not e.group_ids:
            self._call("release", "release", lease_id)
            return {"kind": "error", "group_ids": [], "problem": e.problem + f" (lease {lease_id} released, not acked)"}
        reason = e.problem if len(e.group_ids) == 1 else str(e).removeprefix("bad batch: ")
        try:
            self._call("reject", "reject_lease", lease_id, e.group_ids, reason)
        except Exception as err:  # expired or unreachable: the groups come back and are rejected then
            log.warning("rejecting groups %s of lease %s failed (%s); they will be leased and checked again",
                        e.group_ids, lease_id, err)
        else:
            self.groups_rejected += len(e.group_ids)
        log.warning("rejected %d group(s) of lease %s (dead-lettered, the lease's other groups are back in the "
                    "queue): %s", len(e.group_ids), lease_id, str(e))
        limit = self.cfg.trainer.max_rejected_fraction
        floor = self.cfg.trainer.steps * self.cfg.rollout.groups_per_step
        if self.groups_rejected > limit * max(self.groups_leased, floor):
            return {"kind": "error", "group_ids": e.group_ids,
                    "problem": f"{e.problem}; {self.groups_rejected} of the {self.groups_leased} groups leased were "
                               f"rejected, more than trainer.max_rejected_fraction={limit} allows: stopping"}
        return None

    def next(self) -> Leased | None:
        """The next batch on every rank; raises ``BadBatchError`` on every rank when too many groups were
        rejected."""
        msg = [self._lease_rank0() if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(msg, src=0)
        m = msg[0]
        if m["kind"] == "stop":
            log.info(m["reason"])
            return None
        if m["kind"] == "error":
            raise BadBatchError(m["group_ids"], m["problem"])
        return m["leased"]

    @contextmanager
    def release_on_failure(self, leased: Leased) -> Iterator[None]:
        """Release the lease (rank 0) if the block raises; the error propagates unchanged."""
        try:
            yield
        except BaseException:
            self._release([leased], "after a failed step")
            raise

    def hold(self, leased: Leased) -> None:
        """The step is trained: its lease is held (``trained: true``) until a checkpoint covers it (rank 0)."""
        if self.client is None or leased.lease_id is None:
            return
        try:
            self._call("extend", "extend_lease", leased.lease_id, self.cfg.buffer.lease_s, trained=True)
        except Exception as e:
            if not (isinstance(e, BufferError) and expired(e)):
                self._release([leased], "after a failed extend")
                raise
            self._replayed(leased, e)
            return
        self.held.append(leased)
        if self.keeper is not None:
            self.keeper.track(leased.lease_id, trained=True)

    def ack_held(self) -> None:
        """A checkpoint containing every held step is durable: ack them all (rank 0)."""
        held, self.held = self.held, []
        for leased in held:
            if self.keeper is not None:
                self.keeper.forget(leased.lease_id)
            try:
                self._call("ack", "ack", leased.lease_id)
            except Exception as e:
                if not (isinstance(e, BufferError) and expired(e)):
                    raise
                self._replayed(leased, e)
            else:
                self.groups_acked += leased.batch.num_groups
        if held:
            log.info("acked %d lease(s) covered by the checkpoint (%d groups consumed by this trainer)",
                     len(held), self.groups_acked)

    def release_held(self, why: str) -> None:
        """Return every held lease: their training will not be saved, they will be trained again."""
        held, self.held = self.held, []
        if held:
            log.warning("releasing %d held lease(s) %s: their groups will be trained again", len(held), why)
        self._release(held, why)

    def _replayed(self, leased: Leased, e: Exception) -> None:
        self.groups_replayed += leased.batch.num_groups
        log.warning("lease %s expired before its checkpoint (%s): its %d groups %s are back in the queue and will "
                    "be trained again", leased.lease_id, e, leased.batch.num_groups, leased.batch.group_ids)

    def _release(self, leases: list[Leased], why: str) -> None:
        for leased in leases:
            if self.client is None or leased.lease_id is None:
                continue
            if self.keeper is not None:
                self.keeper.forget(leased.lease_id)
            try:
                self._call("release", "release", leased.lease_id)
            except Exception as e:  # the buffer is unreachable too: report, don't mask the original
                log.warning("releasing lease %s %s failed: %s", leased.lease_id, why, e)

    def set_policy_version(self, v: int) -> None:
        """Tell the buffer (rank 0) the trainer's policy version; later leases skip groups too stale for it."""
        self.min_version = lease_floor(v, self.cfg.buffer.max_staleness)
        if self.client is not None:
            self._call("policy_version", "set_policy_version", v)

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()
        if self.client is not None:
            self.client.close()
