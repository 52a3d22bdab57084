"""EngineControl's weight sync against an engine whose rendezvous never answers: bounded by
``trainer.sync_timeout_s`` and interrupted by SIGTERM (the trainer's ``StopRequest``).

The engine is a real listening socket that never answers (HTTP connects, no reply); the trainer
side is the real ``WeightSender`` (its own rendezvous thread, the real fan-out).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from types import SimpleNamespace

import pytest

from headrace.shared.config import HeadraceConfig
from headrace.shared.weight_sync import EngineTarget, WeightSyncError
from headrace.trainer.lease import StopInterrupt, StopRequest
from headrace.trainer.rollout_control import EngineControl


@pytest.fixture
def silent_engine():
    """A TCP port that accepts connections and never answers a request."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _control(tmp_path, url: str, timeout_s: float, stop: StopRequest | None) -> EngineControl:
    cfg = HeadraceConfig.model_validate({"model": str(tmp_path), "trainer": {"sync_timeout_s": timeout_s}})
    ctl = EngineControl(cfg, SimpleNamespace(rank=0, dp_rank=0), "http://127.0.0.1:9", stop)
    ctl.rollout.close()
    ctl.rollout = SimpleNamespace(engines=lambda: [EngineTarget(url=url, world_size=1)], close=lambda: None)
    return ctl


def _state() -> SimpleNamespace:
    import torch

    return SimpleNamespace(policy_version=1, model=SimpleNamespace(hf_state_dict=lambda **kw: iter([("w", torch.zeros(2))])))


def test_a_rendezvous_that_never_answers_is_bounded_by_sync_timeout(tmp_path, silent_engine):
    ctl = _control(tmp_path, silent_engine, timeout_s=2.0, stop=None)
    with pytest.raises(WeightSyncError, match=silent_engine.split("//")[1]):
        ctl.sync_weights(_state())


def test_a_rendezvous_that_never_answers_is_interrupted_by_sigterm(tmp_path, silent_engine):
    stop = StopRequest()
    stop.install()
    try:
        ctl = _control(tmp_path, silent_engine, timeout_s=3600.0, stop=stop)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(StopInterrupt, match="SIGTERM while joining the weight-sync group"):
            ctl.sync_weights(_state())
        assert stop.requested and ctl.sender is None      # abandoned: close() sends nothing through it
        ctl.close()
    finally:
        stop.uninstall()


def test_a_failed_sync_rejoins_the_group_and_pushes_again(tmp_path, monkeypatch):
    """An engine that restarted left the group: the sender rejoins and the whole update goes again."""
    from headrace.trainer import rollout_control

    monkeypatch.setattr(rollout_control.EngineControl, "_sleep", lambda self, s: None)
    calls: list[str] = []

    class Sender:
        connected = True

        def update(self, named, version):
            names = [n for n, _ in named]
            calls.append(f"update:{version}:{names}")
            if calls.count(f"update:{version}:{names}") == 1:
                self.connected = False
                raise WeightSyncError("http://engine: connection refused", ["http://engine"])

        def reconnect(self):
            calls.append("reconnect")
            self.connected = True

    ctl = _control(tmp_path, "http://unused", timeout_s=5.0, stop=None)
    ctl.info = SimpleNamespace(rank=0, dp_rank=0, tp=1)
    ctl.sender = Sender()
    ctl.sync_weights(_state())
    assert calls == ["update:1:['w']", "reconnect", "update:1:['w']"]


def test_a_restarted_engine_gets_the_current_weights_while_the_trainer_waits(tmp_path):
    """The rollout keeps a restarted engine (initial weights) out of use: no group would ever come."""
    calls: list[str] = []
    engines = [{"url": "http://engine", "stale": True}]
    ctl = _control(tmp_path, "http://unused", timeout_s=5.0, stop=None)
    ctl.info = SimpleNamespace(rank=0, dp_rank=0, tp=1)
    ctl.rollout = SimpleNamespace(status=lambda: {"engines": engines}, pause=lambda mode: calls.append("pause"),
                                  resume=lambda v: calls.append(f"resume:{v}"), close=lambda: None)
    ctl.sender = SimpleNamespace(connected=True, update=lambda named, v: calls.append(f"update:{v}"))
    ctl.refresh_stale(_state())
    assert calls == ["pause", "update:1", "resume:1"]
    engines[0]["stale"] = False
    ctl.refresh_stale(_state())                       # every engine current: nothing to do
    assert calls == ["pause", "update:1", "resume:1"]
