"""The two training loops, the checkpointer's cadence and the metrics row, without processes.

The loops run against a real ``LeaseSource`` (real batch validation) whose buffer client, rollout
control and ``train_step`` are recorders, so the order of the phases is checked exactly as
``trainer.loop``'s docstring states it, with the lease's fate (hold then ack after the checkpoint,
reject, or release) on every path.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from headrace.shared.config import HeadraceConfig
from headrace.shared.schemas import Group, Sample
from headrace.trainer import checkpoint, loop
from headrace.trainer.checkpoint import Checkpointer
from headrace.trainer.lease import LeaseSource, StopRequest
from headrace.trainer.metrics import StepMetrics, step_row
from headrace.trainer.rollout_control import NoRollout, build_rollout_control


def _group(g: int) -> Group:
    prompt = [5, 6, 7]
    return Group(group_id=f"g{g}", samples=[
        Sample(uid=f"g{g}-{i}", group_id=f"g{g}", index=i, tokens=prompt + [8 + i, 9], response_length=2,
               loss_mask=[1, 1], reward=float(i)) for i in range(2)])


class FakeBuffer:
    """BufferClient's calls the loop makes, recorded into ``events``; ``leases`` batches, then dry."""

    def __init__(self, events: list[str], leases: int, poison: set[int] = frozenset(),
                 expired: set[str] = frozenset()) -> None:
        self.events, self.left, self.n = events, leases, 0
        self.poison, self.expired = poison, expired   # leases with a bad group; leases the buffer forgot

    def lease(self, n: int, **_: Any) -> Any:
        if self.left == 0:
            return None
        self.left -= 1
        self.n += 1
        self.events.append("lease")
        groups = [_group(self.n * 10 + k) for k in range(n)]
        if self.n in self.poison:
            groups[0].samples[0].tokens[-1] = 10_000     # outside the vocabulary of 64
        return SimpleNamespace(lease_id=f"L{self.n}", groups=groups)

    def _settle(self, what: str, lease_id: str) -> None:
        if lease_id in self.expired:
            from headrace.shared.client import BufferError
            raise BufferError(409, "lease expired", "POST", f"/v1/leases/{lease_id}/{what}")
        self.events.append(f"{what}:{lease_id}")

    def extend_lease(self, lease_id: str, lease_s: float, trained: bool = False) -> dict:
        self._settle("hold" if trained else "extend", lease_id)
        return {}

    def reject_lease(self, lease_id: str, group_ids: list[str], reason: str) -> dict:
        self.events.append(f"reject:{lease_id}:{','.join(group_ids)}:{reason}")
        return {}

    def stats(self) -> Any:
        return SimpleNamespace(queued=0, leased=0, consumed=0)

    def ack(self, lease_id: str) -> None:
        self._settle("ack", lease_id)

    def release(self, lease_id: str) -> None:
        self.events.append(f"release:{lease_id}")

    def set_policy_version(self, v: int) -> None:
        self.events.append(f"publish:{v}")

    def close(self) -> None:
        pass


class RecordingRollout(NoRollout):
    def __init__(self, events: list[str], fail_in: str | None = None) -> None:
        self.events, self.fail_in = events, fail_in

    def _do(self, name: str) -> None:
        self.events.append(name)
        if name == self.fail_in:
            raise RuntimeError(f"{name} failed")

    def generate(self) -> None:
        self._do("generate")

    def release_memory(self) -> None:
        self._do("release_memory")

    def resume_memory(self) -> None:
        self._do("resume_memory")

    def pause(self) -> None:
        self._do("pause")

    def sync_weights(self, st: Any) -> None:
        self._do(f"sync:{st.policy_version}")

    def resume(self, version: int) -> None:
        self._do(f"resume:{version}")

    def evaluate(self, step: int) -> dict[str, Any]:
        self._do(f"evaluate:{step}")
        return {"eval_score": 0.5} if step % 2 == 0 else {}

    def phase_times(self) -> dict[str, float]:
        return {"weight_sync_s": 0.0}


def _run(monkeypatch, tmp_path, *, leases: int, steps: int = 2, start_step: int = 0, fail_in: str | None = None,
         save_every: int = 0, max_rejected_fraction: float = 0.1, **fake: Any) -> tuple[loop.Run, list[str]]:
    events: list[str] = []
    cfg = HeadraceConfig.model_validate({"model": str(tmp_path), "rollout": {"groups_per_step": 2},
                                         "trainer": {"lease_wait_s": 0.01, "steps": steps,
                                                                     "max_rejected_fraction": max_rejected_fraction}})
    st = SimpleNamespace(step=start_step, policy_version=start_step, groups_consumed=0, samples_consumed=0)

    def fake_train_step(state: Any, batch: Any) -> dict[str, float]:
        events.append("train")
        if fail_in == "train":
            raise FloatingPointError("train failed")
        state.step += 1
        return {"loss": 0.1, "approx_kl": 0.01, "samples": len(batch.samples)}

    monkeypatch.setattr(loop, "train_step", fake_train_step)
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda s, d, keep=2: events.append(f"save:{s.step}") or d)
    source = LeaseSource(cfg, "http://unused", None, 0, vocab_size=64, max_seq_len=64)
    source.client.close()
    source.client, source.keeper = FakeBuffer(events, leases, **fake), None
    metrics = StepMetrics(None)
    return loop.Run(st, steps, source, RecordingRollout(events, fail_in), Checkpointer(st, tmp_path, save_every),
                    metrics, StopRequest()), events


ON_DEMAND_STEP = ["generate", "release_memory", "lease", "train", "publish:{v}", "resume_memory", "sync:{v}",
                  "resume:{v}", "hold:L{v}", "evaluate:{v}"]
CONTINUOUS_STEP = ["lease", "train", "publish:{v}", "pause", "sync:{v}", "resume:{v}", "hold:L{v}", "evaluate:{v}"]


def _steps(template: list[str], versions: range) -> list[str]:
    return [e.format(v=v) for v in versions for e in template]


@pytest.mark.parametrize("mode,template", [("on_demand", ON_DEMAND_STEP), ("continuous", CONTINUOUS_STEP)])
def test_each_loop_runs_its_phases_in_order(monkeypatch, tmp_path, mode, template):
    r, events = _run(monkeypatch, tmp_path, leases=5, steps=2)
    assert loop.LOOPS[mode](r) is False
    assert events == ["evaluate:0"] + _steps(template, range(1, 3))   # baseline, then two steps, held
    r.checkpoint(last=True)                                           # what run_training does at the end
    assert events[-3:] == ["save:2", "ack:L1", "ack:L2"]              # acked only once a checkpoint has them
    assert (r.st.step, r.st.policy_version, r.st.groups_consumed, r.st.samples_consumed) == (2, 2, 4, 8)
    row = r.metrics.last
    assert (row["policy_version"], row["data_weight_version"]) == (2, 0)
    assert row["eval_score"] == 0.5 and row["weight_sync_s"] == 0.0 and row["staleness"] == 1


@pytest.mark.parametrize("mode,first", [("on_demand", ["sync:3", "resume:3"]),
                                        ("continuous", ["pause", "sync:3", "resume:3"])])
def test_a_resumed_run_pushes_its_weights_before_the_first_step(monkeypatch, tmp_path, mode, first):
    r, events = _run(monkeypatch, tmp_path, leases=5, steps=4, start_step=3)
    loop.LOOPS[mode](r)
    assert events[:len(first)] == first and "evaluate:3" not in events[:len(first)]
    assert r.st.step == 4


@pytest.mark.parametrize("mode", ["on_demand", "continuous"])
@pytest.mark.parametrize("fail_in", ["train", "sync:1", "resume:1"])
def test_a_failed_step_releases_its_lease_and_never_acks(monkeypatch, tmp_path, mode, fail_in):
    r, events = _run(monkeypatch, tmp_path, leases=5, fail_in=fail_in)
    with pytest.raises((RuntimeError, FloatingPointError), match="failed"):
        loop.LOOPS[mode](r)
    assert events[-1] == "release:L1" and not any(e.startswith(("ack", "save", "hold")) for e in events)


@pytest.mark.parametrize("mode", ["on_demand", "continuous"])
def test_train_only_stops_when_the_buffer_runs_dry(monkeypatch, tmp_path, mode):
    r, events = _run(monkeypatch, tmp_path, leases=1, steps=5)
    assert loop.LOOPS[mode](r) is False           # not a stop request
    assert r.st.step == 1 and events.count("hold:L1") == 1 and "ack:L1" not in events


def test_a_stop_request_ends_the_loop_after_the_step_it_arrived_in(monkeypatch, tmp_path):
    r, events = _run(monkeypatch, tmp_path, leases=5, steps=5)
    original = r.source.hold

    def hold_then_sigterm(leased: Any) -> None:
        original(leased)
        r.stop.requested = True

    r.source.hold = hold_then_sigterm
    assert loop.train_continuous(r) is True
    assert r.st.step == 1 and events[-1] == "evaluate:1"
    r.checkpoint(last=True)
    assert events[-2:] == ["save:1", "ack:L1"]                       # the final checkpoint, then the ack


def test_leases_are_held_until_a_checkpoint_contains_their_steps(monkeypatch, tmp_path):
    r, events = _run(monkeypatch, tmp_path, leases=5, steps=5, save_every=2)
    assert loop.train_continuous(r) is False          # dry after 5 leases
    settled = [e for e in events if e.startswith(("hold", "save", "ack"))]
    assert settled == ["hold:L1", "hold:L2", "save:2", "ack:L1", "ack:L2", "hold:L3", "hold:L4", "save:4",
                       "ack:L3", "ack:L4", "hold:L5"]
    r.checkpoint(last=True)
    assert events[-2:] == ["save:5", "ack:L5"] and r.source.held == []


def test_a_poison_group_is_rejected_and_training_goes_on(monkeypatch, tmp_path, caplog):
    # 3 steps x 2 groups: a fraction of 0.2 allows one rejected group (1 <= 0.2 x 6)
    r, events = _run(monkeypatch, tmp_path, leases=5, steps=3, poison={2}, max_rejected_fraction=0.2)
    assert loop.train_continuous(r) is False
    rejects = [e for e in events if e.startswith("reject")]
    assert rejects == ["reject:L2:g20:sample 'g20-0': token id 10000 is outside the vocabulary [0, 64)"]
    assert r.st.step == 3 and [e for e in events if e.startswith("hold")] == ["hold:L1", "hold:L3", "hold:L4"]
    assert "rejected 1 group(s) of lease L2" in caplog.text and "outside the vocabulary" in caplog.text
    assert (r.source.groups_leased, r.source.groups_rejected) == (8, 1)


def test_too_many_rejected_groups_stop_the_loop(monkeypatch, tmp_path):
    # 2 steps x 2 groups = 4 groups at least: 0.1 of it allows no rejection beyond 0.4
    r, events = _run(monkeypatch, tmp_path, leases=5, steps=2, poison={1})
    from headrace.trainer.batch import BadBatchError
    with pytest.raises(BadBatchError, match="max_rejected_fraction"):
        loop.train_continuous(r)
    assert events[-1].startswith("reject:L1:g10:") and r.st.step == 0


def test_an_expired_held_lease_is_logged_as_replayed_not_fatal(monkeypatch, tmp_path, caplog):
    r, events = _run(monkeypatch, tmp_path, leases=5, steps=2, save_every=2, expired={"L1"})
    assert loop.train_continuous(r) is False
    assert [e for e in events if e.startswith(("hold", "save", "ack"))] == ["hold:L2", "save:2", "ack:L2"]
    assert "lease L1 expired before its checkpoint" in caplog.text and "trained again" in caplog.text
    assert r.source.groups_replayed == 2 and r.source.groups_acked == 2


def test_buffer_calls_are_retried_through_an_outage_and_logged(monkeypatch, caplog):
    from headrace.shared.client import BufferError
    from headrace.trainer import buffer_link

    monkeypatch.setattr(buffer_link.time, "sleep", lambda s: None)
    answers = [BufferError(0, "ConnectError"), BufferError(503, "restarting"), "ok"]

    def call(x: int) -> str:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a + str(x)

    assert buffer_link.retrying("ack", call, 1) == "ok1"
    assert caplog.text.count("buffer ack failed") == 2
    with pytest.raises(BufferError, match="409"):       # a 409 is an answer, not an outage: at once
        buffer_link.retrying("ack", lambda: (_ for _ in ()).throw(BufferError(409, "expired")))
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(buffer_link.time, "monotonic", lambda: next(clock))
    with pytest.raises(BufferError, match="no answer"):  # bounded by BUFFER_OUTAGE_S in all
        buffer_link.retrying("lease", lambda: (_ for _ in ()).throw(BufferError(0, "down")))
    assert "giving up" in caplog.text


def test_checkpointer_owns_the_cadence(monkeypatch, tmp_path):
    written: list[int] = []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda s, d, keep=2: written.append(s.step) or d)
    st = SimpleNamespace(step=0)
    ckpt = Checkpointer(st, tmp_path, every=2)
    assert ckpt.save(0, last=True) is None         # nothing trained yet: nothing to write
    for step in range(1, 6):
        st.step = step
        ckpt.save(step)
    ckpt.save(5, last=True)                          # the last step, not on the interval
    ckpt.save(5, last=True)                          # never the same step twice
    assert written == [2, 4, 5]
    with pytest.raises(ValueError, match="step 5"):
        ckpt.save(6)

    written.clear()
    only_last = Checkpointer(SimpleNamespace(step=7), tmp_path, every=0)   # as if resumed at step 7
    only_last.save(7, last=True)                     # the state it started from is already on disk
    only_last.st.step = 8
    only_last.save(8)
    only_last.save(8, last=True)
    assert written == [8]


def test_two_kl_columns_never_one_that_switches():
    common = dict(policy_version=3, data_weight_version=1, lease_wait_s=0.5, samples=8, iteration_s=2.0)
    no_ref = step_row({"loss": 1.0, "approx_kl": 0.01}, **common)
    assert no_ref["approx_kl"] == 0.01 and "kl_ref" not in no_ref and "kl" not in no_ref
    with_ref = step_row({"loss": 1.0, "approx_kl": 0.01, "kl_ref": 0.2}, **common)
    assert (with_ref["approx_kl"], with_ref["kl_ref"]) == (0.01, 0.2) and "kl" not in with_ref
    assert (with_ref["staleness"], with_ref["samples_per_s"], with_ref["weight_version"]) == (1, 4.0, 3)
    with pytest.raises(ValueError, match="kl_ref or approx_kl"):
        step_row({"kl": 0.1}, **common)


def test_rollout_control_plugin_and_defaults(tmp_path):
    cfg = HeadraceConfig.model_validate({"model": str(tmp_path)})
    assert isinstance(build_rollout_control(cfg, None, None), NoRollout)
    cfg = HeadraceConfig.model_validate({"model": str(tmp_path), "trainer": {
        "weight_sync_hook": "tests.trainer.test_loop_phases:plugin_factory"}})
    made = build_rollout_control(cfg, "info", "http://rollout")
    assert isinstance(made, RecordingRollout) and made.events == ["info", "http://rollout"]


def plugin_factory(config: HeadraceConfig, info: Any, rollout_url: str | None) -> RecordingRollout:
    """A ``trainer.weight_sync_hook`` plugin: ``factory(config, info, rollout_url) -> RolloutControl``."""
    return RecordingRollout([info, rollout_url])


class FakeRolloutClient:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.args: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append(name)
            self.args.append((name, args))
            return {"score": 0.25, "reward_mean": 0.5, "n": 4} if name == "evaluate" else {}
        return call


def test_engine_control_times_its_phases_owns_the_eval_cadence_and_gives_memory_back(tmp_path):
    from headrace.trainer.rollout_control import EngineControl

    cfg = HeadraceConfig.model_validate({"model": str(tmp_path), "run": {"eval_every": 2}, "trainer": {"steps": 5}})
    ctl = EngineControl(cfg, SimpleNamespace(rank=0, dp_rank=0), "http://127.0.0.1:9")
    ctl.rollout.close()
    calls: list[str] = []
    sent: list[tuple[list[str], int]] = []
    ctl.rollout = FakeRolloutClient(calls)
    ctl.sender = SimpleNamespace(connected=True, update=lambda named, v: sent.append(([n for n, _ in named], v)),
                                 close=lambda: calls.append("sender.close"))
    st = SimpleNamespace(policy_version=3, model=SimpleNamespace(hf_state_dict=lambda **kw: iter([("w", None)])))
    ctl.generate()
    ctl.release_memory()
    ctl.resume_memory()
    ctl.sync_weights(st)
    ctl.resume(3)
    assert calls == ["generate_batch", "release_memory", "resume_memory", "resume"] and sent == [(["w"], 3)]
    # the version it pushed and resumed with is named to generate_batch (the service need not ask
    # every engine); none before the first resume, and none again from a sync until its resume
    client = ctl.rollout
    ctl.generate()
    ctl.sync_weights(st)
    ctl.generate()
    gens = [a for name, a in client.args if name == "generate_batch"]
    assert gens == [(cfg.rollout.groups_per_step, None), (cfg.rollout.groups_per_step, 3),
                    (cfg.rollout.groups_per_step, None)]
    calls.clear()
    assert set(ctl.phase_times()) == {"generate_s", "release_memory_s", "resume_memory_s", "weight_sync_s",
                                      "resume_s"}
    assert ctl.phase_times() == {}                                   # reset after each read
    assert [bool(ctl.evaluate(s)) for s in range(6)] == [True, False, True, False, True, True]   # 0, every 2, last
    calls.clear()
    ctl.release_memory()                                             # a step that then failed
    ctl.close()
    assert calls == ["release_memory", "resume_memory", "sender.close", "close"]
