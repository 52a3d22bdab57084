"""The trainer's side of the RL loop that involves the rollout service: generation on demand,
memory offload, weight sync to the engines, and evaluation.

``EngineSync`` is the ``WeightSyncHook`` that ``headrace train`` uses whenever it has a rollout
URL. It follows DESIGN.md's two loops:

    continuous (async):    lease -> train -> put version -> pause -> sync weights -> resume(v) -> ack
    on_demand (colocated): generate_batch -> release memory -> lease -> train -> resume memory -> sync -> resume(v) -> ack

Guarantees: the rollout resumes only after every engine confirmed the new weight version
(``WeightSender.update`` verifies it, else raises ``WeightSyncError`` naming the engine, and the
step fails with its lease released); only the ranks of data-parallel replica 0 take part in the
TP gather, and only global rank 0 talks HTTP; evaluation results are returned as metrics of the
step (``eval_score`` = pass@1 on the held-out prompts, ``eval_reward_mean``) every ``run.eval_every``
steps and at the last step (``trainer.steps``), plus a baseline at step 0 of a fresh run; a resumed
run first pushes its restored weights to the engines (``initial_metrics``), so the engines never
serve the initial weights under the resumed version.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from headrace.shared.config import HeadraceConfig

log = logging.getLogger("headrace.trainer.sync")


class EngineSync:
    """Keeps the rollout's engines on the trainer's policy (see module docstring)."""

    def __init__(self, cfg: HeadraceConfig, info: Any, rollout_url: str) -> None:
        self.cfg, self.info = cfg, info
        self.rank0 = info.rank == 0
        self.gathers = info.dp_rank == 0          # TP ranks of replica 0 join the hf_state_dict collective
        self.on_demand = cfg.rollout.mode == "on_demand" or cfg.run.placement == "colocated"
        self.rollout = None
        self.sender = None
        if self.rank0:
            from headrace.shared.rollout_client import RolloutClient

            self.rollout = RolloutClient(rollout_url, timeout=max(600.0, cfg.trainer.sync_timeout_s))
        self.released = False
        self.timings: dict[str, float] = {}   # this step's phase times (rank 0), logged with its metrics

    # -- evaluation --

    def evaluate(self, step: int) -> dict[str, Any]:
        """Rank 0: score the engines' current policy on the held-out prompts."""
        if not self.rank0 or not self.cfg.run.eval_every:
            return {}
        t0 = time.perf_counter()
        res = self.rollout.evaluate()
        log.info("step %d: eval score %.3f (n=%d)", step, res["score"], res["n"])
        return {"eval_score": res["score"], "eval_reward_mean": res["reward_mean"], "eval_n": res["n"],
                "eval_s": time.perf_counter() - t0}

    def initial_metrics(self, st: Any) -> dict[str, Any]:
        """Before the first step. A fresh run: the baseline evaluation (logged as step 0). A resumed
        run: push the restored policy to the engines first, so that nothing is generated and tagged
        with the resumed version by weights the engines loaded from ``cfg.model`` (collective on the
        ranks of replica 0, like every sync)."""
        if st.step == 0:
            return self.evaluate(st.step)
        version = st.policy_version
        if self.rank0 and not self.on_demand:
            self.rollout.pause("abort")
        t0 = time.perf_counter()
        self._sync(st, version)
        if self.rank0:
            self.rollout.resume(version)
            log.info("resumed at step %d: engines now serve policy version %d (%.2fs)", st.step, version,
                     time.perf_counter() - t0)
        return {}

    # -- hook --

    def before_lease(self, st: Any) -> None:
        self.timings = {}
        if self.on_demand and self.rank0:
            t0 = time.perf_counter()
            self.rollout.generate_batch(self.cfg.rollout.groups_per_step)
            t1 = time.perf_counter()
            self.rollout.release_memory()
            self.released = True
            self.timings = {"generate_s": t1 - t0, "release_memory_s": time.perf_counter() - t1}

    def after_update(self, st: Any, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self.rank0:
            if self.on_demand:
                self.rollout.resume_memory()
                self.released = False
            else:
                self.rollout.pause("abort")
        t1 = time.perf_counter()
        self._sync(st, version)
        sync_s = time.perf_counter() - t1
        metrics: dict[str, Any] = {}
        if self.rank0:
            self.rollout.resume(version)
            metrics = {**self.timings, "weight_sync_s": sync_s,
                       ("resume_memory_s" if self.on_demand else "pause_s"): t1 - t0,
                       "resume_s": time.perf_counter() - t1 - sync_s}
            every = self.cfg.run.eval_every
            if every and (st.step % every == 0 or st.step == self.cfg.trainer.steps):
                metrics.update(self.evaluate(st.step))
        return metrics

    def _sync(self, st: Any, version: int) -> None:
        if not self.gathers:
            return
        named = st.model.hf_state_dict()
        if not self.rank0:
            for _ in named:      # other TP ranks of replica 0: take part in the gather collectives
                pass
            return
        if self.sender is None:
            self.sender = self._connect()
        self.sender.update(named, version)

    def _connect(self) -> Any:
        import torch

        from headrace.shared.weight_sync import WeightSender

        t = self.cfg.trainer
        engines = self.rollout.engines()
        sender = WeightSender(engines, backend="nccl" if torch.cuda.is_available() else "gloo",
                              master_address=t.sync_address, bucket_bytes=int(t.bucket_mb * (1 << 20)),
                              timeout_s=t.sync_timeout_s)
        sender.connect()
        log.info("weight-sync group joined by %d engine(s): %s", len(engines), ", ".join(e.url for e in engines))
        return sender

    def close(self) -> None:
        if self.rank0:
            try:
                if self.released:
                    self.rollout.resume_memory()
            except Exception as e:  # closing after an error: report, don't mask the original
                log.warning("resume_memory at close failed: %s", e)
            if self.sender is not None:
                self.sender.close()
            self.rollout.close()


def build(cfg: HeadraceConfig, info: Any, rollout_url: str | None) -> Any:
    """``trainer.weight_sync_hook`` factory: EngineSync with a rollout URL, else no sync."""
    if rollout_url is None:
        from headrace.trainer.loop import NoWeightSync

        return NoWeightSync()
    return EngineSync(cfg, info, rollout_url)
