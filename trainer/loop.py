"""The ``headrace train`` loop, run on every trainer rank; rank 0 drives.

One loop per rollout mode (``headrace.shared.config.rollout_mode``: colocated placement is always
on_demand), each phase one line::

    on_demand (colocated): generate -> release memory -> lease -> train -> publish version
                           -> resume memory -> sync weights -> resume(v) -> hold -> evaluate
    continuous (async):    lease -> train -> publish version -> pause -> sync weights -> resume(v)
                           -> hold -> evaluate

then, after every step: log its metrics row (``trainer.metrics.StepMetrics``), hand the step to the
checkpointer (``trainer.checkpoint.Checkpointer`` decides whether to write) and, when it wrote, ack
every held lease; agree on a stop. "hold" marks the step's lease trained (held, kept alive) until a
durable checkpoint contains the step: a group is consumed exactly when that checkpoint exists.
"publish version" is policy_version += 1 and ``PUT /v1/policy_version``. The phases that involve
the engines are methods of a ``RolloutControl`` (``trainer.rollout_control``: ``NoRollout`` in
train-only mode, ``EngineControl`` with a rollout URL, or the ``trainer.weight_sync_hook`` plugin);
the lease, its validation, rejection, hold, ack or release are ``trainer.lease.LeaseSource``'s (rank 0
leases for every rank and broadcasts the batch; its docstring says why); the update is
``trainer.step.train_step``.

Guarantees:
- Exactly-once: a step's lease is acked only after a durable checkpoint containing the step was
  written (every ``trainer.save_every`` steps, and when the loop ends for any reason but an
  error). After a kill -9 the held leases expire and the resumed trainer trains their groups again.
- A bad group (``BadBatchError``: token outside the vocabulary, prompts that differ within a
  group, non-finite reward, no trainable token, ...) is rejected (dead-lettered with its reason,
  logged) and training goes on; only when more than ``trainer.max_rejected_fraction`` of the
  groups leased were rejected does the loop stop with the error, after a checkpoint of the state
  before the bad lease (and the ack of what it covers).
- Any failure during a step before its hold (train, publish, memory, sync, resume) releases the
  lease on rank 0 before the error propagates; an error that ends training releases the held
  leases too (their training is not saved: they will be trained again).
- Several rollout services (``--rollout-url`` repeated, scale-out): one ``EngineControl`` drives them
  all as one (pause all, one weight sync over all their engines, resume all).
- Train-only mode (no rollout URL): the loop trains on what the buffer holds and stops cleanly when
  fewer than ``groups_per_step`` groups arrive within ``lease_wait_s``. With a rollout URL it waits.
- Resumes from ``checkpoint_dir/latest`` when present (model, optimizer, schedule, step, version),
  and before the first step pushes the restored weights to the engines, so they never serve the
  initial weights under the resumed version. A fresh run evaluates first (the step-0 baseline).
- SIGTERM (preemption, ``docker stop``, ``headrace run``'s Ctrl-C) is a request to stop: the step
  in progress finishes (unless it waits on a weight sync: ``StopInterrupt`` abandons the sync, the
  step's lease and the held ones are released, nothing is saved: the run resumes from the last
  checkpoint and trains those groups again), every rank agrees at the step boundary, a checkpoint of that step is
  written, every held lease is acked and the loop returns normally (no HF export: the run is not
  finished). A rank 0 waiting for groups notices within ``trainer.lease.STOP_POLL_S``.
"""

from __future__ import annotations

import logging
import random
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from headrace.shared.config import HeadraceConfig, rollout_mode
from headrace.trainer.batch import BadBatchError
from headrace.trainer.checkpoint import Checkpointer, export_hf
from headrace.trainer.lease import Leased, LeaseSource, StopInterrupt, StopRequest
from headrace.trainer.metrics import MetricsWriter, StepMetrics
from headrace.trainer.optim import build_optimizer, build_scheduler
from headrace.trainer.rollout_control import RolloutControl, build_rollout_control, rollout_urls
from headrace.trainer.step import TrainerState, train_step

log = logging.getLogger("headrace.trainer")


@dataclass
class Run:
    """What a loop drives: the trainer state and the objects each phase calls."""

    st: TrainerState
    steps: int                  # trainer.steps: the loop ends when st.step reaches it
    source: LeaseSource
    rollout: RolloutControl
    ckpt: Checkpointer
    metrics: StepMetrics
    stop: StopRequest

    def begin(self, *, pause_first: bool) -> None:
        """Before the first step: a fresh run logs the step-0 evaluation; a resumed run first makes
        the engines serve the restored policy (never the initial weights under the resumed version)."""
        st, rollout = self.st, self.rollout
        if st.step == 0:
            self.metrics.log_baseline(st.step, st.policy_version, rollout.evaluate(st.step))
            return
        if pause_first:
            rollout.pause()
        rollout.sync_weights(st)
        rollout.resume(st.policy_version)
        log.info("resumed at step %d: engines now serve policy version %d", st.step, st.policy_version)

    def train(self, leased: Leased) -> dict[str, float]:
        """train -> publish version: the update is the next policy version; count the lease's
        groups and tell the buffer."""
        out = train_step(self.st, leased.batch)
        self.st.policy_version += 1
        self.st.groups_consumed += leased.batch.num_groups
        self.st.samples_consumed += len(leased.batch.samples)
        self.source.set_policy_version(self.st.policy_version)
        return out

    def end_step(self, leased: Leased, train: dict[str, float]) -> bool:
        """hold -> evaluate -> metrics row -> checkpoint (the checkpointer decides) and ack -> agree
        on a stop. True when every rank agreed to stop."""
        self.source.hold(leased)
        st = self.st
        self.metrics.log_step(train, st.policy_version, leased, self.rollout.phase_times(), self.rollout.evaluate(st.step))
        self.checkpoint()
        return self.stop.agreed()

    def checkpoint(self, last: bool = False) -> None:
        """Hand the step to the checkpointer; once it wrote (durably), ack every held lease."""
        if self.ckpt.save(self.st.step, last=last) is not None:
            self.source.ack_held()


def train_on_demand(r: Run) -> bool:
    """Synchronous (colocated): the engines generate one batch with the current policy and give the
    devices to the trainer, which trains on exactly that batch and hands the new weights back.
    Returns True when stopped on request (SIGTERM), False when done or the buffer ran dry."""
    st, rollout, source = r.st, r.rollout, r.source
    r.begin(pause_first=False)
    while st.step < r.steps:
        r.metrics.start_step()
        rollout.generate()
        rollout.release_memory()
        leased = source.next()
        if leased is None:                      # stop requested while waiting, or train-only and dry
            return r.stop.agreed()
        with source.release_on_failure(leased):
            train = r.train(leased)             # train -> publish version
            rollout.resume_memory()
            rollout.sync_weights(st)
            rollout.resume(st.policy_version)
        if r.end_step(leased, train):           # hold -> evaluate -> metrics -> checkpoint, ack -> stop?
            return True
    return False


def train_continuous(r: Run) -> bool:
    """Asynchronous (disaggregated): the rollout generates ahead into the buffer (within
    ``buffer.max_staleness`` versions) while the trainer trains; generation pauses only for the
    weight sync. Returns True when stopped on request (SIGTERM), False when done or dry."""
    st, rollout, source = r.st, r.rollout, r.source
    r.begin(pause_first=True)
    while st.step < r.steps:
        r.metrics.start_step()
        leased = source.next()
        if leased is None:                      # stop requested while waiting, or train-only and dry
            return r.stop.agreed()
        with source.release_on_failure(leased):
            train = r.train(leased)             # train -> publish version
            rollout.pause()
            rollout.sync_weights(st)
            rollout.resume(st.policy_version)
        if r.end_step(leased, train):           # hold -> evaluate -> metrics -> checkpoint, ack -> stop?
            return True
    return False


LOOPS = {"on_demand": train_on_demand, "continuous": train_continuous}


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
    if t.lora is not None:      # frozen base + adapters; the KL reference is the base (adapters off)
        from headrace.trainer.lora import AdaptersOff, apply_lora

        apply_lora(model, t.lora, base_path=cfg.model, seed=t.seed)
        ref = AdaptersOff(model) if t.kl_coef > 0 else None
    elif t.kl_coef > 0:
        ref = load_model(cfg.model, info, dtype=_dtype(t.dtype))
        ref.requires_grad_(False)
        ref.eval()
    opt = build_optimizer(model, t)
    temp = cfg.rollout.sampling.temperature
    return TrainerState(model=model, optimizer=opt, scheduler=build_scheduler(opt, t), cfg=t, info=info,
                        ref_model=ref, temperature=temp if temp > 0 else 1.0)


def wait_for_services(cfg: HeadraceConfig, buffer_url: str, rollout_urls: Sequence[str], stop: StopRequest) -> None:
    """Rank 0, once the model is built: wait until the buffer and every rollout service answer
    /health (the buffer 60 s at most, a rollout service ``rollout.engines.startup_timeout_s`` + 60 s,
    its engines' start included). So the trainer may be started together with them (``headrace
    run`` does: its imports and model load overlap their start); a service that is already up
    costs one request. A SIGTERM ends the wait."""
    from headrace.shared.procs import wait_http

    def stopping() -> str | None:
        return "stop requested (SIGTERM) while waiting for the services" if stop.requested else None

    waits = [(f"{buffer_url.rstrip('/')}/health", 60.0)]
    waits += [(f"{u.rstrip('/')}/health", cfg.rollout.engines.startup_timeout_s + 60.0) for u in rollout_urls]
    for url, timeout_s in waits:
        try:
            wait_http(url, 0.5, stopping)
        except TimeoutError:
            log.info("waiting for %s (at most %.0fs)", url, timeout_s)
            wait_http(url, timeout_s, stopping)


def run_training(cfg: HeadraceConfig, buffer_url: str, rollout_url: str | Sequence[str] | None = None,
                 rollout: RolloutControl | None = None) -> dict[str, Any]:
    """Train on this rank until ``trainer.steps`` (or the buffer runs dry in train-only mode).

    Expects the torchrun-style environment (``trainer.launch.spawn`` sets it). ``rollout``
    overrides ``build_rollout_control``. Returns a summary (steps done, policy version, last
    metrics, whether it stopped on request) on every rank.
    """
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    info = init_distributed(t.tp, t.dp)
    try:
        st = build_state(cfg, info)
        ckpt = Checkpointer(st, cfg.resolved_path(t.checkpoint_dir, "ckpt"), every=t.save_every)
        ckpt.resume()
        with ExitStack() as cleanup:
            stop = StopRequest()
            stop.install()
            cleanup.callback(stop.uninstall)
            arch = st.model.arch
            urls = rollout_urls(rollout_url)
            if info.rank == 0 and rollout is None:
                wait_for_services(cfg, buffer_url, urls, stop)
            source = LeaseSource(cfg, buffer_url, urls[0] if urls else None, info.rank, arch.vocab_size,
                                 arch.max_position_embeddings, stop)
            cleanup.callback(source.close)
            out = Path(cfg.run.out)
            metrics = StepMetrics(MetricsWriter(out / "metrics.jsonl", out / "tensorboard" if t.tensorboard else None)
                                  if info.rank == 0 else None)
            cleanup.callback(metrics.close)
            rollout = rollout or build_rollout_control(cfg, info, urls, stop)
            cleanup.callback(rollout.close)
            source.set_policy_version(st.policy_version)
            if rollout_mode(cfg) == "continuous" and hasattr(rollout, "refresh_stale"):
                source.on_wait = lambda: rollout.refresh_stale(st)   # a restarted engine gets the weights again
            run = Run(st, t.steps, source, rollout, ckpt, metrics, stop)
            try:
                stopped = LOOPS[rollout_mode(cfg)](run)
            except BadBatchError:   # too many rejected, raised by the lease only: nothing of it was trained
                run.checkpoint(last=True)
                raise
            except StopInterrupt as e:   # mid-sync: the model holds a step whose lease was released
                log.warning("%s; no checkpoint of step %d", e, st.step)
                source.release_held("after SIGTERM during a weight sync (training since the last checkpoint is lost)")
                return {"rank": info.rank, "step": ckpt.saved_step, "policy_version": None,
                        "groups_consumed": None, "last": metrics.last, "stopped": True}
            except BaseException:
                source.release_held("after an error (the state that trained them is not saved)")
                raise
            run.checkpoint(last=True)
            if stopped:
                log.info("stopped at step %d on request; checkpoint in %s", st.step, ckpt.directory)
            elif t.export_hf:
                export_hf(st, cfg.resolved_path(t.export_hf_dir, "hf"), cfg.model)
        return {"rank": info.rank, "step": st.step, "policy_version": st.policy_version,
                "groups_consumed": st.groups_consumed, "last": metrics.last, "stopped": stopped}
    finally:
        destroy_distributed()


def run_training_from_dict(cfg_dict: dict[str, Any], buffer_url: str,
                           rollout_url: str | Sequence[str] | None) -> dict[str, Any]:
    """Picklable entry point for ``trainer.launch.spawn`` (the config travels as a plain dict)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    return run_training(HeadraceConfig.model_validate(cfg_dict), buffer_url, rollout_url)
