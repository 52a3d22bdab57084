"""The trainer's control of the rollout service: the phases of the RL loop that are not training.

``RolloutControl`` is what ``trainer.loop`` calls for every phase that involves the engines:
generate a batch on demand, release and resume their memory, pause, sync weights, resume at a
version, evaluate. Every method is called on every trainer rank; an implementation decides which
ranks act (here: only global rank 0 talks HTTP; the ranks of data-parallel replica 0 take part in
the TP gather of a weight sync).

- ``NoRollout``: every phase does nothing (train-only mode: no rollout URL; or engines that load
  checkpoints themselves). A base class for plugins that override only some phases.
- ``EngineControl``: the rollout service over HTTP and weight sync to its engines over
  torch.distributed (``headrace.shared.weight_sync.WeightSender``). Given several rollout URLs
  (scale-out: ``headrace train --rollout-url A --rollout-url B``), it drives them all as one
  (``trainer.rollout_services.RolloutServices``): every phase goes to every service, one
  weight-sync group spans all their engines (rank offsets continuing across services), the same
  buckets reach every engine as one version, and the rollout resumes only after every engine of
  every service confirmed it; a failure names the engine and its service.

``build_rollout_control`` picks one: the plugin named by ``trainer.weight_sync_hook:
module:function`` when set (called on every rank as ``factory(config, info, rollout_url)`` with the
first rollout URL; further ones are in ``config.rollout.extra_urls``; the object it returns
implements ``RolloutControl``), else ``EngineControl`` with rollout URLs and ``NoRollout`` without.

Guarantees of ``EngineControl``: a weight sync (joining the weight-sync group, then each update)
is bounded by ``trainer.sync_timeout_s`` (``WeightSyncError`` naming the engine that did not
answer) and, given the run's ``StopRequest``, interrupted by SIGTERM within ``STOP_POLL_S``
(``StopInterrupt``: the sync is abandoned in its thread; the next trainer's connect clears what it
left on the engines); with ``trainer.tp`` 1 a failed sync (an engine restarted, say) rejoins the
group and pushes the whole update again, with backoff, for at most ``sync_timeout_s`` in all
before the error ends the step; the rollout resumes only after every engine confirmed the new weight version (``WeightSender.update`` verifies it, else raises ``WeightSyncError`` naming the
engine, and the step fails with its lease released); evaluation (``eval_score`` = pass@1 on the
held-out prompts, ``eval_reward_mean``) runs at step 0 of a fresh run, every ``run.eval_every``
steps and at the last step (``trainer.steps``): it owns that cadence like the checkpointer owns its
own; memory released for a step that then fails is resumed at ``close``. ``generate_batch`` names
the weight version that this process last pushed and resumed with, so the service tags the batch
without asking every engine; before the first resume, and from the start of a sync until the
resume after it, it names none (the service then reads the engines' version).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, Sequence

from headrace.shared.config import HeadraceConfig
from headrace.shared.weight_sync.fanout import spawn
from headrace.shared.weight_sync.adapter import adapter_mode
from headrace.shared.weight_sync.protocol import WeightSyncError
from headrace.trainer.lease import StopInterrupt, StopRequest

log = logging.getLogger("headrace.trainer.rollout")


class RolloutControl(Protocol):
    """The rollout phases of the loop; called on every trainer rank, in the loop's order."""

    def generate(self) -> None:
        """On-demand: have the rollout generate ``groups_per_step`` groups into the buffer with the current policy."""

    def release_memory(self) -> None:
        """On-demand: the engines free their device memory for the trainer."""

    def resume_memory(self) -> None:
        """On-demand: the engines take their memory back (before a weight sync)."""

    def pause(self) -> None:
        """Continuous: stop generation (requests in flight are aborted) before a weight sync."""

    def sync_weights(self, st: Any) -> None:
        """Push ``st.model``'s weights to every engine as version ``st.policy_version`` (a collective)."""

    def resume(self, version: int) -> None:
        """Generation may go on; what the engines generate now is tagged with ``version``."""

    def evaluate(self, step: int) -> dict[str, Any]:
        """Evaluation metrics when ``step`` is due for one (its own cadence), else ``{}``."""

    def phase_times(self) -> dict[str, float]:
        """Seconds each phase took since the last call (``generate_s``, ``weight_sync_s``, ...); resets."""

    def close(self) -> None:
        """At the end of training (also after an error)."""


class NoRollout:
    """No rollout to control: every phase is a no-op (train-only mode). Subclass to override some."""

    def generate(self) -> None:
        pass

    def release_memory(self) -> None:
        pass

    def resume_memory(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def sync_weights(self, st: Any) -> None:
        pass

    def resume(self, version: int) -> None:
        pass

    def evaluate(self, step: int) -> dict[str, Any]:
        return {}

    def phase_times(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class EngineControl:
    """The rollout service and its engines (see the module docstring)."""

    STOP_POLL_S = 0.2   # how soon a SIGTERM interrupts a weight sync

    def __init__(self, cfg: HeadraceConfig, info: Any, rollout_url: str | Sequence[str],
                 stop: StopRequest | None = None) -> None:
        self.cfg, self.info, self.stop = cfg, info, stop
        self.rank0 = info.rank == 0
        self.gathers = info.dp_rank == 0          # TP ranks of replica 0 join the hf_state_dict collective
        self.rollout = None
        self.sender = None
        if self.rank0:
            from headrace.trainer.rollout_services import RolloutServices

            self.rollout = RolloutServices(rollout_urls(rollout_url), timeout=max(600.0, cfg.trainer.sync_timeout_s),
                                           token=cfg.auth.token)
            self.rollout.check_layout()   # several services: their prompt shards must not collide
        self.released = False
        # the version this process last pushed to every engine and resumed with: generate_batch names
        # it, so the service need not ask each engine (None until then: a restarted trainer's engines
        # may hold anything, and the service's reading of them decides)
        self.synced: int | None = None
        self.times: dict[str, float] = {}

    def _timed(self, name: str, call: Any) -> None:
        """Rank 0: make the HTTP call and record its time as this step's ``name``."""
        if self.rank0:
            t0 = time.perf_counter()
            call()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def generate(self) -> None:
        self._timed("generate_s", lambda: self.rollout.generate_batch(self.cfg.rollout.groups_per_step, self.synced))

    def release_memory(self) -> None:
        self._timed("release_memory_s", lambda: self.rollout.release_memory())
        self.released = self.rank0

    def resume_memory(self) -> None:
        self._timed("resume_memory_s", lambda: self.rollout.resume_memory())
        self.released = False

    def pause(self) -> None:
        self._timed("pause_s", lambda: self.rollout.pause("abort"))

    def resume(self, version: int) -> None:
        self.synced = None   # unknown if the call fails half-way
        self._timed("resume_s", lambda: self.rollout.resume(version))
        self.synced = version

    def sync_weights(self, st: Any) -> None:
        self.synced = None   # the engines may hold either version until the resume that follows
        if adapter_mode(self.cfg):    # trainer.lora_sync: adapter: a PEFT directory, loaded by every engine
            from headrace.trainer.lora_adapter_sync import sync_adapter

            return sync_adapter(self, st)
        if not self.gathers:
            return
        t0 = time.perf_counter()
        named = self._named(st)
        if not self.rank0:
            for _ in named:      # other TP ranks of replica 0: take part in the gather collectives
                pass
            return
        retry = getattr(self.info, "tp", 1) == 1     # no other rank takes part in the gather: it can be redone
        budget = self.cfg.trainer.sync_timeout_s
        attempt = 0
        while True:
            try:
                self._push(named, st.policy_version)
                break
            except WeightSyncError as e:
                attempt += 1
                if not retry or time.perf_counter() - t0 > budget:
                    raise
                log.warning("weight sync of version %d failed (%s); retry %d: rejoining the group (an engine "
                            "that restarted must join again), for at most %.0fs in all", st.policy_version, e,
                            attempt, budget)
                self._sleep(min(10.0, 2.0 * attempt))
                named = self._named(st)
        self.times["weight_sync_s"] = time.perf_counter() - t0

    @staticmethod
    def _named(st: Any) -> Any:
        """The tensors a sync sends (a TP collective): the whole model, or with LoRA (``lora_sync:
        merged``) only the targeted weights, merged (``W + alpha / rank * B A``): the rest is the
        frozen base the engines already serve."""
        if getattr(st.model, "lora_state", None) is not None:
            from headrace.trainer.lora import merged_tensors

            return merged_tensors(st.model)
        return st.model.hf_state_dict(copy=False)   # packed or sent before the next step changes them

    def refresh_stale(self, st: Any) -> None:
        """Rank 0, while it waits for groups (continuous mode, tp 1): an engine that restarted serves its
        initial weights, and the rollout keeps it out of use (``stale``) until it has the current ones,
        so no group comes and the trainer would wait forever. Push them again (pause, sync, resume); a
        failure is logged and tried again at the next wait."""
        if not self.rank0 or getattr(self.info, "tp", 1) != 1:
            return
        stale = [e.get("url") for e in self.rollout.status().get("engines", []) if e.get("stale")]
        if not stale:
            return
        log.warning("engine(s) %s serve stale weights (restarted?): pushing policy version %d again",
                    ", ".join(map(str, stale)), st.policy_version)
        try:
            self.pause()
            self.sync_weights(st)
            self.resume(st.policy_version)
        except WeightSyncError as e:
            log.warning("pushing the weights to the stale engine(s) failed (%s); trying again at the next wait", e)

    def _sleep(self, seconds: float) -> None:
        """Wait between sync attempts; StopInterrupt when SIGTERM arrives meanwhile."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if self.stop is not None and self.stop.requested:
                raise StopInterrupt("SIGTERM while waiting to retry a weight sync")
            time.sleep(min(self.STOP_POLL_S, max(0.0, end - time.perf_counter())))

    def _push(self, named: Any, version: int) -> None:
        try:
            if self.sender is None:
                self.sender = self._until_stopped("joining the weight-sync group", self._connect)
            elif not self.sender.connected:
                self._until_stopped("rejoining the weight-sync group", self.sender.reconnect)
            self._until_stopped(f"weight sync of version {version}", self.sender.update, named, version)
        except WeightSyncError as e:
            raise self._with_services(e) from e

    def _with_services(self, e: WeightSyncError) -> WeightSyncError:
        """``e`` with the rollout service of each failing engine named (when several services)."""
        where = getattr(self.rollout, "service_of", None)
        if where is None or len(getattr(self.rollout, "urls", ())) < 2:
            return e
        named = [f"engine {u} of rollout service {where(u)}" for u in e.urls if where(u)]
        return WeightSyncError(f"{e} ({'; '.join(named)})", e.urls) if named else e

    def _until_stopped(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a daemon thread (it is bounded by sync_timeout_s itself); StopInterrupt when
        SIGTERM arrives first. The abandoned sender is dropped: nothing more is sent through it."""
        if self.stop is None:
            return fn(*args)
        fut = spawn(fn, *args)
        while True:
            try:
                return fut.result(timeout=self.STOP_POLL_S)
            except TimeoutError:
                if self.stop.requested:
                    self.sender = None
                    raise StopInterrupt(f"SIGTERM while {what}: abandoned") from None

    def evaluate(self, step: int) -> dict[str, Any]:
        every = self.cfg.run.eval_every
        if not (self.rank0 and every and (step % every == 0 or step == self.cfg.trainer.steps)):
            return {}
        t0 = time.perf_counter()
        res = self.rollout.evaluate()
        log.info("step %d: eval score %.3f (n=%d)", step, res["score"], res["n"])
        return {"eval_score": res["score"], "eval_reward_mean": res["reward_mean"], "eval_n": res["n"],
                "eval_s": time.perf_counter() - t0}

    def phase_times(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out

    def _connect(self) -> Any:
        import torch

        from headrace.shared.weight_sync import WeightSender

        t = self.cfg.trainer
        engines = self.rollout.engines()
        sender = WeightSender(engines, backend="nccl" if torch.cuda.is_available() else "gloo",
                              master_address=t.sync_address, bucket_bytes=int(t.bucket_mb * (1 << 20)),
                              timeout_s=t.sync_timeout_s, token=self.cfg.auth.token)
        sender.connect()
        log.info("weight-sync group joined by %d engine(s) of %d rollout service(s): %s", len(engines),
                 len(getattr(self.rollout, "urls", [None])), ", ".join(e.url for e in engines))
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


def rollout_urls(rollout_url: str | Sequence[str] | None) -> list[str]:
    """The rollout URLs as a list: one URL, several (scale-out), or none (train-only mode)."""
    if rollout_url is None:
        return []
    return [rollout_url] if isinstance(rollout_url, str) else list(rollout_url)


def build_rollout_control(cfg: HeadraceConfig, info: Any, rollout_url: str | Sequence[str] | None,
                          stop: StopRequest | None = None) -> RolloutControl:
    """The plugin of ``trainer.weight_sync_hook`` (``factory(config, info, rollout_url)``, given the
    first URL) when set; else ``EngineControl`` over every rollout URL (a weight sync interruptible by
    ``stop``), ``NoRollout`` without one."""
    urls = rollout_urls(rollout_url)
    spec = cfg.trainer.weight_sync_hook
    if spec:
        from headrace.shared.plugins import load_plugin

        return load_plugin(spec, what="trainer.weight_sync_hook")(cfg, info, urls[0] if urls else None)
    return EngineControl(cfg, info, urls, stop) if urls else NoRollout()
