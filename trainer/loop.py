"""The ``headrace train`` loop, run on every trainer rank; rank 0 drives.

Per step::

    hook.before_lease -> lease N groups (rank 0) -> validate -> broadcast -> train_step (all ranks)
    -> policy_version += 1 -> PUT /v1/policy_version -> hook.after_update (weight sync) -> ack -> metrics

Why rank 0 leases for everyone and broadcasts the batch (instead of each DP rank leasing its share):
one lease per step means one ack or one release — a step is consumed or returned whole, never
half; validation happens once, so every rank agrees whether a batch is bad and nobody blocks in a
collective; and advantages and loss normalisers need the whole batch's rewards and token counts,
which every rank then has without extra communication. The batch is token ids and a few floats per
token: broadcasting it costs little next to a training step. ``trainer.batch`` then gives each DP
rank a token-balanced share.

Guarantees:
- A bad batch (``BadBatchError``: token outside the vocabulary, prompts that differ within a
  group, non-finite reward, no trainable token, ...) is released, not acked; the error names the
  group; model, optimizer and counters are exactly as before the lease (a checkpoint of that state
  is written when ``checkpoint_dir`` is set) and the loop stops with the error.
- Any failure during a step releases the lease on rank 0 before the error propagates.
- Train-only mode (no rollout URL): the loop trains on what the buffer holds and stops cleanly when
  fewer than ``groups_per_step`` groups arrive within ``lease_wait_s``. With a rollout URL it waits.
- Resumes from ``checkpoint_dir/latest`` when present (model, optimizer, schedule, step, version).
- SIGTERM (preemption, ``docker stop``, ``headrace run``'s Ctrl-C) is a request to stop: the step
  in progress finishes and is acked, every rank agrees at the step boundary, a checkpoint of that
  step is written and the loop returns normally (no HF export: the run is not finished). A rank 0
  waiting for groups notices within ``STOP_POLL_S``.

``WeightSyncHook`` is where weight sync to the engines plugs in (the default does nothing);
configure one with ``trainer.weight_sync_hook: module:function`` — a factory called on every rank
as ``factory(config, info, rollout_url) -> WeightSyncHook``.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from headrace.shared.config import HeadraceConfig
from headrace.trainer.batch import BadBatchError, TrainBatch, build_batch
from headrace.trainer.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from headrace.trainer.metrics import MetricsWriter
from headrace.trainer.optim import build_optimizer, build_scheduler
from headrace.trainer.step import TrainerState, train_step

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


class WeightSyncHook(Protocol):
    """Called on every rank; implementations decide which ranks talk to the rollout service."""

    def before_lease(self, st: TrainerState) -> None:
        """Before each lease (on-demand mode: ask the rollout to generate the next batch)."""

    def after_update(self, st: TrainerState, version: int) -> dict[str, Any] | None:
        """After the optimizer step and the policy-version PUT, before the ack (pause, sync, resume).

        May return extra metrics for this step (e.g. ``eval_score``)."""

    def close(self) -> None:
        """At the end of training (also after an error)."""


class NoWeightSync:
    """The default hook: nothing to sync (train-only mode, or engines that load checkpoints)."""

    def before_lease(self, st: TrainerState) -> None:
        pass

    def after_update(self, st: TrainerState, version: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Leased:
    lease_id: str | None
    batch: TrainBatch
    weight_version: int
    wait_s: float


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

    def finish(self, leased: Leased, ok: bool) -> None:
        """Ack (``ok``) or release the lease; rank 0 only."""
        if self.client is None or leased.lease_id is None:
            return
        (self.client.ack if ok else self.client.release)(leased.lease_id)

    def set_policy_version(self, v: int) -> None:
        self.min_version = max(0, v - self.cfg.buffer.max_staleness)
        if self.client is not None:
            self.client.set_policy_version(v)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_state(cfg: HeadraceConfig, info: Any) -> TrainerState:
    """Model (+ frozen reference when kl_coef > 0), optimizer and schedule for this rank."""
    from headrace.trainer.model import load_model

    t = cfg.trainer
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    np.random.seed(t.seed)
    model = load_model(cfg.model, info, dtype=_dtype(t.dtype))
    ref = None
    if t.kl_coef > 0:
        ref = load_model(cfg.model, info, dtype=_dtype(t.dtype))
        ref.requires_grad_(False)
        ref.eval()
    opt = build_optimizer(model, t)
    temp = cfg.rollout.sampling.temperature
    return TrainerState(model=model, optimizer=opt, scheduler=build_scheduler(opt, t), cfg=t, info=info,
                        ref_model=ref, temperature=temp if temp > 0 else 1.0)


def _make_hook(cfg: HeadraceConfig, info: Any, rollout_url: str | None) -> WeightSyncHook:
    spec = cfg.trainer.weight_sync_hook
    if not spec:
        if rollout_url is None:
            return NoWeightSync()
        from headrace.trainer.sync import EngineSync

        return EngineSync(cfg, info, rollout_url)
    from headrace.shared.plugins import load_plugin

    return load_plugin(spec, what="trainer.weight_sync_hook")(cfg, info, rollout_url)


def run_training(cfg: HeadraceConfig, buffer_url: str, rollout_url: str | None = None,
                 hook: WeightSyncHook | None = None) -> dict[str, Any]:
    """Train on this rank until ``trainer.steps`` (or the buffer runs dry in train-only mode).

    Expects the torchrun-style environment (``trainer.launch.spawn`` sets it). Returns a summary
    (steps done, policy version, last metrics) on every rank.
    """
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    info = init_distributed(t.tp, t.dp)
    try:
        st = build_state(cfg, info)
        ckpt_dir = cfg.resolved_path(t.checkpoint_dir, "ckpt")
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None:
            load_checkpoint(st, latest)
            log.info("resumed from %s (step %d, policy version %d)", latest, st.step, st.policy_version)
        arch = st.model.arch
        stop = StopRequest()
        stop.install()
        source = LeaseSource(cfg, buffer_url, rollout_url, info.rank, arch.vocab_size, arch.max_position_embeddings,
                             stop)
        out = Path(cfg.run.out)
        writer = MetricsWriter(out / "metrics.jsonl", out / "tensorboard" if t.tensorboard else None) \
            if info.rank == 0 else None
        hook = hook or _make_hook(cfg, info, rollout_url)
        last: dict[str, Any] = {}
        saved_at = st.step
        stopped = False
        try:
            source.set_policy_version(st.policy_version)
            initial = getattr(hook, "initial_metrics", None)
            first = initial(st) if initial is not None else None
            if first and writer is not None:
                writer.log({"step": st.step, "policy_version": st.policy_version, **first})
            while st.step < t.steps:
                t0 = time.perf_counter()
                hook.before_lease(st)
                try:
                    leased = source.next()
                except BadBatchError:
                    if st.step > saved_at:
                        save_checkpoint(st, ckpt_dir)
                    raise
                if leased is None:
                    break
                try:
                    metrics = train_step(st, leased.batch)
                    st.policy_version += 1
                    st.groups_consumed += leased.batch.num_groups
                    st.samples_consumed += len(leased.batch.samples)
                    source.set_policy_version(st.policy_version)
                    extra = hook.after_update(st, st.policy_version) or {}
                except BaseException:
                    source.finish(leased, ok=False)
                    raise
                source.finish(leased, ok=True)
                dt = time.perf_counter() - t0
                last = {**metrics, **extra, "policy_version": st.policy_version, "weight_version": st.policy_version,
                        "data_weight_version": leased.weight_version,
                        "kl": metrics.get("kl", metrics.get("approx_kl")), "lease_wait_s": leased.wait_s,
                        "staleness": st.policy_version - 1 - leased.weight_version,
                        "samples_per_s": len(leased.batch.samples) / dt if dt > 0 else 0.0, "iteration_s": dt}
                if writer is not None:
                    writer.log(last)
                if t.save_every and st.step % t.save_every == 0:
                    save_checkpoint(st, ckpt_dir)
                    saved_at = st.step
                if stop.agreed():
                    stopped = True
                    break
            stopped = stopped or stop.agreed()   # e.g. rank 0 was told while waiting for groups
            if st.step > saved_at:
                save_checkpoint(st, ckpt_dir)
            if stopped:
                log.info("stopped at step %d on request; checkpoint in %s", st.step, ckpt_dir)
            elif t.export_hf:
                export_hf(st, cfg.resolved_path(t.export_hf_dir, "hf"), cfg.model)
        finally:
            stop.uninstall()
            hook.close()
            source.close()
            if writer is not None:
                writer.close()
        return {"rank": info.rank, "step": st.step, "policy_version": st.policy_version,
                "groups_consumed": st.groups_consumed, "last": last, "stopped": stopped}
    finally:
        destroy_distributed()


def run_training_from_dict(cfg_dict: dict[str, Any], buffer_url: str, rollout_url: str | None) -> dict[str, Any]:
    """Picklable entry point for ``trainer.launch.spawn`` (the config travels as a plain dict)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    return run_training(HeadraceConfig.model_validate(cfg_dict), buffer_url, rollout_url)
