"""The engine's weight-update session (``rollout.engine.session.UpdateSession``): every invalid
transition answers a clear error, a failed bucket marks the weights partial until a clean session,
and the HTTP endpoints validate bodies with the sender's own models. The receiver is a stand-in
(no process group): the transport is covered by tests/shared/test_weight_sync.py."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from headrace.rollout.engine.receiver import ReceiveCancelled, WeightReceiver
from headrace.rollout.engine.session import SessionError, State, UpdateSession
from headrace.rollout.engine.weights import DictTarget, make_receiver_app
from headrace.shared.weight_sync.protocol import (DestroyGroupRequest, InitGroupRequest, UpdateBucketRequest, parse,
                                                  wire)
from tests.procs import free_port

GROUP = "g"


class FakeReceiver:
    """Joins nothing; ``receive`` returns ones of the announced shapes, optionally after ``gate``;
    with ``honours_cancel`` it gives the wait up when the session cancels it (as the real one does)."""

    def __init__(self) -> None:
        self.group_name: str | None = None
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.honours_cancel = False

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        self.group_name = group_name

    def receive(self, names: Any, dtypes: Any, shapes: Any, load_format: Any = None, dest: Any = None,
                cancelled: Any = None) -> list:
        self.entered.set()
        if self.gate is not None:
            deadline = time.monotonic() + 30
            while not self.gate.wait(0.01) and time.monotonic() < deadline:
                if self.honours_cancel and cancelled():
                    raise ReceiveCancelled("given up")
        return [(n, torch.ones(s)) for n, s in zip(names, shapes)]

    def destroy(self) -> None:
        self.group_name = None


class RecordingTarget(DictTarget):
    def __init__(self) -> None:
        super().__init__({"w": torch.zeros(2)})
        self.updating: list[bool] = []

    def set_updating(self, updating: bool) -> None:
        self.updating.append(updating)

    def load(self, named: list, version: str | None) -> None:
        for name, t in named:   # as the reference engine's model does
            if t.shape != self.tensors[name].shape:
                raise ValueError(f"{name}: shape {list(t.shape)} != {list(self.tensors[name].shape)}")
        super().load(named, version)


def init(group: str = GROUP) -> InitGroupRequest:
    return InitGroupRequest(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2,
                            group_name=group, backend="gloo")


def bucket(version: str | None = None, shape: list[int] = [2], group: str = GROUP) -> UpdateBucketRequest:  # noqa: B006
    return UpdateBucketRequest(names=["w"], dtypes=["float32"], shapes=[shape], group_name=group,
                               weight_version=version)


@pytest.fixture
def session() -> UpdateSession:
    s = UpdateSession(RecordingTarget(), receiver=FakeReceiver(), destroy_wait_s=0.0)
    s.init_group(init())
    return s


def test_a_whole_update_sets_the_version_and_stops_generation_meanwhile(session: UpdateSession) -> None:
    target = session.target
    session.begin()
    assert session.state is State.OPEN and target.updating == [True]
    session.bucket(bucket())
    assert target.weight_version == "default"           # only the bucket that carries it sets the version
    assert "Weight version updated to 4" in session.bucket(bucket("4"))
    session.end()
    assert session.state is State.IDLE and target.updating == [True, False]
    assert target.weight_version == "4" and torch.equal(target.tensors["w"], torch.ones(2))
    assert session.broken is None


def test_bucket_before_begin_and_end_without_begin_are_refused(session: UpdateSession) -> None:
    with pytest.raises(SessionError, match="outside a weight update session: call /begin_weight_update"):
        session.bucket(bucket("1"))
    with pytest.raises(SessionError, match="no weight update session is open"):
        session.end()
    assert session.target.weight_version == "default" and session.target.updating == []


def test_begin_inside_a_session_is_refused(session: UpdateSession) -> None:
    session.begin()
    with pytest.raises(SessionError, match="already open; call /end_weight_update first"):
        session.begin()
    session.end()


def test_a_bucket_for_another_group_or_no_group_is_refused(session: UpdateSession) -> None:
    session.begin()
    with pytest.raises(SessionError, match="no weight update group named 'other'"):
        session.bucket(bucket(group="other"))
    session.destroy_group(DestroyGroupRequest(group_name=GROUP))   # allowed inside a session
    with pytest.raises(SessionError, match="call /init_weights_update_group first"):
        session.bucket(bucket())
    assert session.state is State.OPEN
    session.end()


def test_group_rules(session: UpdateSession) -> None:
    with pytest.raises(SessionError, match=r"already exists; destroy it first"):
        session.init_group(init("second"))
    with pytest.raises(SessionError, match="no weight update group named 'nope'"):
        session.destroy_group(DestroyGroupRequest(group_name="nope"))
    session.destroy_group(DestroyGroupRequest(group_name=GROUP))
    with pytest.raises(SessionError, match="no weight update group"):
        session.destroy_group(DestroyGroupRequest(group_name=GROUP))
    session.init_group(init("second"))
    assert session.group == "second"


def test_destroy_end_or_bucket_during_a_bucket_are_refused(session: UpdateSession) -> None:
    receiver = session.receiver
    receiver.gate = threading.Event()
    session.begin()
    worker = threading.Thread(target=session.bucket, args=(bucket("2"),))
    worker.start()
    try:
        assert receiver.entered.wait(30)
        assert session.state is State.RECEIVING
        with pytest.raises(SessionError, match="is being received; destroy the group after its answer"):
            session.destroy_group(DestroyGroupRequest(group_name=GROUP))
        with pytest.raises(SessionError, match="being received: end the session after its answer"):
            session.end()
        with pytest.raises(SessionError, match="already being received"):
            session.bucket(bucket())
        with pytest.raises(SessionError, match="already open"):
            session.begin()
    finally:
        receiver.gate.set()
        worker.join(30)
    assert session.state is State.OPEN and session.group == GROUP
    session.end()
    assert session.target.weight_version == "2"
    session.destroy_group(DestroyGroupRequest(group_name=GROUP))


def test_a_destroy_during_a_bucket_gives_its_receive_up(session: UpdateSession) -> None:
    """A new trainer (rank 0) destroys the group a killed one left mid-bucket: the receive is given
    up, the bucket fails (weights partial), the group goes and a new one can be joined."""
    receiver = session.receiver
    receiver.gate, receiver.honours_cancel = threading.Event(), True
    session.destroy_wait_s = 10.0
    session.begin()
    errors: list[str] = []

    def run() -> None:
        try:
            session.bucket(bucket("2"))
        except SessionError as e:
            errors.append(str(e))

    worker = threading.Thread(target=run)
    worker.start()
    assert receiver.entered.wait(30)
    assert "Succeeded to destroy" in session.destroy_group(DestroyGroupRequest(group_name=GROUP))
    worker.join(30)
    assert errors and "ReceiveCancelled: given up" in errors[0] and "partially" in errors[0]
    assert session.group is None and session.state is State.FAILED and session.broken
    with pytest.raises(SessionError, match="the session had a failed update"):
        session.end()
    session.init_group(init("again"))
    assert session.group == "again" and session.target.weight_version == "default"


def _rank0(port: int, group: str, send: bool) -> None:
    """The trainer's side of a group: join, then broadcast ones (send) or stay silent; then wait to
    be killed (no shared event: a killed waiter would block its ``set``)."""
    import torch.distributed as dist

    from headrace.shared.weight_sync.group import join_update_group

    pg = join_update_group("127.0.0.1", port, 0, 2, group, "gloo", 60)
    if send:
        dist.broadcast(torch.ones(1000), src=0, group=pg)
    time.sleep(120)


def test_a_real_gloo_receive_is_given_up_by_a_destroy_and_a_new_group_works() -> None:
    """Real gloo (two processes). The case: a trainer killed in mid-broadcast that gloo did not
    notice (the engine then waited for the group timeout, 600 s). Here rank 0 joins and stays
    silent, then is killed; the destroy gives the receive up within a wait slice (before the kill,
    so it is the give-up, not gloo, that ends it), the group goes once rank 0 is gone, and a new
    group delivers a whole update."""
    ctx = mp.get_context("spawn")
    target = RecordingTarget()
    target.tensors["w"] = torch.zeros(1000)
    session = UpdateSession(target, receiver=WeightReceiver(), timeout_s=60, destroy_wait_s=10.0)
    silent = ctx.Process(target=_rank0, args=(port := free_port(), "silent", False))
    silent.start()
    live = None
    try:
        session.init_group(InitGroupRequest(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                            world_size=2, group_name="silent", backend="gloo"))
        session.begin()
        errors: list[str] = []
        worker = threading.Thread(target=lambda: errors.append(_fails(session, bucket("4", [1000], "silent"))))
        worker.start()
        time.sleep(1.0)    # the receive is waiting for rank 0's data, which never comes
        assert session.state is State.RECEIVING and not errors
        destroyed: list[str] = []
        destroyer = threading.Thread(target=lambda: destroyed.append(
            session.destroy_group(DestroyGroupRequest(group_name="silent"))))
        destroyer.start()
        worker.join(10)    # given up within a wait slice, rank 0 still alive
        assert errors and "ReceiveCancelled" in errors[0] and "partially updated" in errors[0], errors
        silent.kill()      # a live silent peer holds the group's shutdown; a dead one does not
        destroyer.join(30)
        assert destroyed and "Succeeded to destroy" in destroyed[0] and session.group is None
        with pytest.raises(SessionError, match="failed update"):
            session.end()
        live = ctx.Process(target=_rank0, args=(port := free_port(), "live", True))
        live.start()
        session.init_group(InitGroupRequest(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                            world_size=2, group_name="live", backend="gloo"))
        session.begin()
        session.bucket(bucket("5", shape=[1000], group="live"))
        session.end()
        assert target.weight_version == "5" and torch.equal(target.tensors["w"], torch.ones(1000))
        assert session.broken is None
    finally:
        for p in (silent, live):
            if p is not None:
                p.kill()
                p.join(30)


def _fails(session: UpdateSession, req: UpdateBucketRequest) -> str:
    try:
        session.bucket(req)
    except SessionError as e:
        return str(e)
    return "no error"


def test_a_failed_bucket_marks_the_weights_partial_until_a_clean_session(session: UpdateSession) -> None:
    session.begin()
    with pytest.raises(SessionError, match="Failed to update parameter online"):
        session.bucket(bucket("3", shape=[7]))   # the target refuses the shape
    assert session.state is State.FAILED and session.broken
    with pytest.raises(SessionError, match="an earlier bucket of this session failed"):
        session.bucket(bucket("3"))
    with pytest.raises(SessionError, match="the session had a failed update"):
        session.end()
    assert session.state is State.IDLE and session.broken    # still partial: the engine refuses to generate
    assert session.target.weight_version == "default"
    session.begin()
    session.bucket(bucket("4"))
    session.end()
    assert session.broken is None and session.target.weight_version == "4"


# ---- the wire: one set of models for sender and engine ------------------------------------------

def test_bodies_are_validated_strictly_and_named() -> None:
    good = wire(init())
    assert good == {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
                    "group_name": GROUP, "backend": "gloo"}
    assert parse(InitGroupRequest, good) == init()
    for field, bad in (("master_port", "29500"), ("master_port", True), ("world_size", 2.0)):
        with pytest.raises(ValueError, match=field):
            parse(InitGroupRequest, {**good, field: bad})
    with pytest.raises(ValueError, match="rank_offset 2 must be in"):
        parse(InitGroupRequest, {**good, "rank_offset": 2})
    with pytest.raises(ValueError, match="differ in length"):
        parse(UpdateBucketRequest, {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]})
    with pytest.raises(ValueError, match="one dtype"):
        parse(UpdateBucketRequest, {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[1], [1]],
                                    "load_format": "flattened_bucket"})
    req = parse(UpdateBucketRequest, {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": None,
                                      "load_format": None, "weight_version": None, "extra": 1})
    assert req.group_name == "weight_update_group" and req.weight_version is None and req.flush_cache


def test_the_sender_body_is_what_sglang_gets() -> None:
    """``wire`` sends the fields the sender set: a null load_format, no weight_version before the last bucket."""
    body = wire(UpdateBucketRequest(names=["w"], dtypes=["float32"], shapes=[[2]], group_name=GROUP,
                                    load_format=None, flush_cache=False))
    assert body == {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": GROUP,
                    "load_format": None, "flush_cache": False}


def test_http_endpoints_answer_the_session_and_the_validation() -> None:
    app = make_receiver_app()
    with TestClient(app) as client:
        r = client.post("/update_weights_from_distributed", json=wire(bucket("1")))
        assert r.status_code == 400 and r.json() == {
            "success": False, "message": "update_weights_from_distributed outside a weight update session: "
                                         "call /begin_weight_update first"}
        r = client.post("/init_weights_update_group", json={**wire(init()), "master_port": "29500"})
        assert r.status_code == 400 and "master_port" in r.json()["message"]
        r = client.post("/begin_weight_update", content=b"[1]")
        assert r.status_code == 400 and "JSON object" in r.json()["message"]
        assert client.post("/begin_weight_update", json={}).json()["success"] is True
        assert client.post("/end_weight_update").status_code == 200       # an empty body is {}
        r = client.post("/destroy_weights_update_group", json={"group_name": GROUP})
        assert r.status_code == 400 and "no weight update group named 'g'" in r.json()["message"]
