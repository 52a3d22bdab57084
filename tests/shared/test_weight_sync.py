"""Weight sync between real processes: WeightSender (this process, trainer rank 0) and standalone
receivers (``python -m headrace.rollout.engine.weights``: the engine's UpdateSession behind the SGLang
weight-update HTTP API), over a real gloo group on loopback. Engines that die or hang mid-update are real
processes killed (SIGKILL) or stopped (SIGSTOP) by pid."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from headrace.rollout.engine.receiver import WeightReceiver
from headrace.rollout.engine.weights import tensor_digest
from headrace.shared.weight_sync import (EngineTarget, WeightSender, WeightSyncError, contiguous_run,
                                         engines_from_rollout, flatten_bucket, join_update_group, plan_buckets,
                                         unflatten_bucket)
from tests.procs import Proc, child_env, free_port


def start_receiver(tmp: Path, name: str, timeout_s: float = 60.0, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc([sys.executable, "-m", "headrace.rollout.engine.weights", "--port", str(port), "--timeout-s", str(timeout_s), *extra],
                tmp / f"{name}.log", env=child_env(1))
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health", timeout=90)
    return proc, url


def model_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A small mixed-dtype "model": fp32 and bf16 tensors, one larger than a 64 KiB bucket."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 32, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(32, 32, generator=g).bfloat16()),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(32, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(160, 128, generator=g)),  # 80 KiB > bucket
        ("model.layers.0.input_layernorm.weight", torch.randn(32, generator=g).bfloat16()),
        ("model.norm.weight", torch.randn(32, generator=g)),
        ("lm_head.weight", torch.randn(64, 32, generator=g)),
    ]


def digests(url: str) -> dict[str, str]:
    return httpx.get(url + "/weights_digest", timeout=30).json()


def version(url: str) -> str:
    return httpx.get(url + "/get_model_info", timeout=10).json()["weight_version"]


# ---- pure functions ---------------------------------------------------------------------------

def test_plan_buckets_one_dtype_each_bounded_order_kept() -> None:
    tensors = model_tensors(0)
    buckets = list(plan_buckets(tensors, 16 << 10))
    flat_names = [n for b in buckets for n, _ in b]
    assert sorted(flat_names) == sorted(n for n, _ in tensors)
    for b in buckets:
        assert len({t.dtype for _, t in b}) == 1
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 16 << 10 or len(b) == 1
    for dtype in (torch.float32, torch.bfloat16):  # order within a dtype is the input order
        want = [n for n, t in tensors if t.dtype == dtype]
        assert [n for n in flat_names if dict(tensors)[n].dtype == dtype] == want
    with pytest.raises(ValueError, match="appears twice"):
        list(plan_buckets(tensors + tensors[:1], 1 << 20))


def test_contiguous_run_is_a_view_only_of_back_to_back_tensors() -> None:
    flat = torch.arange(24, dtype=torch.float32)
    a, b, c = flat[:6].view(2, 3), flat[6:10], flat[10:24].view(7, 2)
    run = contiguous_run([a, b, c])
    assert run is not None and run.data_ptr() == flat.data_ptr() and torch.equal(run, flat)
    run[0] = -1.0                                  # a view: writing into it writes the tensors
    assert a[0, 0].item() == -1.0
    assert torch.equal(contiguous_run([b, c]), flat[6:])
    assert contiguous_run([b, a]) is None          # out of order
    assert contiguous_run([a, c]) is None          # a gap
    assert contiguous_run([a, flat[6:10].clone()]) is None   # another storage
    assert contiguous_run([flat.view(4, 6)[:, :3]]) is None  # not contiguous
    assert contiguous_run([flat[:6], flat[6:12].to(torch.float64)]) is None
    assert contiguous_run([flat[:0]]) is None and contiguous_run([]) is None


def test_flatten_unflatten_round_trip() -> None:
    bucket = [(n, t) for n, t in model_tensors(1) if t.dtype == torch.float32]
    flat = flatten_bucket(bucket)
    assert flat.dim() == 1 and flat.numel() == sum(t.numel() for _, t in bucket)
    back = unflatten_bucket(flat, [n for n, _ in bucket], [list(t.shape) for _, t in bucket])
    for (n0, t0), (n1, t1) in zip(bucket, back):
        assert n0 == n1 and torch.equal(t0, t1)
    with pytest.raises(ValueError, match="one dtype"):
        flatten_bucket(model_tensors(1)[:2])


# ---- sender <-> two receiver processes -----------------------------------------------------------

@pytest.fixture(scope="module")
def receivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    tmp = tmp_path_factory.mktemp("receivers")
    started = [start_receiver(tmp, f"r{i}") for i in range(2)]
    yield [url for _, url in started]
    for proc, _ in started:
        proc.stop()


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_update_reaches_every_engine_exactly(receivers: list[str], load_format: str | None) -> None:
    sender = WeightSender([EngineTarget(u) for u in receivers], bucket_bytes=64 << 10, timeout_s=60,
                          load_format=load_format)
    sender.connect()
    try:
        for v, seed in ((1, 10), (2, 11)):
            tensors = model_tensors(seed)
            sender.update(iter(tensors), weight_version=v)
            want = {n: tensor_digest(t) for n, t in tensors}
            for url in receivers:
                assert digests(url) == want
                assert version(url) == str(v)
        assert sender.last_stats["buckets"] >= 3  # fp32 and bf16 never share a bucket; one tensor > bucket
        # verification is real: the engines report "2", so expecting "3" must fail, naming both
        with pytest.raises(WeightSyncError) as err:
            sender._verify("3")
        assert sorted(err.value.urls) == sorted(receivers)
    finally:
        sender.shutdown()
    # the engines left the group: a new sender connects with the same group name
    with WeightSender([EngineTarget(u) for u in receivers], timeout_s=60, load_format=load_format) as again:
        again.update(model_tensors(12), weight_version=3)
    assert all(version(u) == "3" for u in receivers)
    assert WeightSender([EngineTarget(receivers[0])]).load_format == "auto"   # chosen per bucket


def _back_to_back(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same values as views of one buffer per dtype, in order (as the trainer holds its
    parameters at TP 1)."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        group = [(n, t) for n, t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for _, t in group])
        offset = 0
        for n, t in group:
            out.append((n, flat[offset:offset + t.numel()].view(t.shape)))
            offset += t.numel()
    return out


def test_auto_sends_back_to_back_buckets_flat_from_their_storage(receivers: list[str]) -> None:
    """load_format "auto" on gloo: a bucket whose tensors are one run of one storage is broadcast
    flat from that storage (no pack copy); separately allocated tensors go one broadcast each. Both
    arrive exactly."""
    with WeightSender([EngineTarget(u) for u in receivers], bucket_bytes=64 << 10, timeout_s=60) as sender:
        tensors = _back_to_back(model_tensors(20))
        sender.update(tensors, weight_version=1)
        assert sender.last_stats["zero_copy_buckets"] == sender.last_stats["buckets"] >= 3
        for url in receivers:
            assert digests(url) == {n: tensor_digest(t) for n, t in tensors} and version(url) == "1"
        separate = model_tensors(21)
        sender.update(separate, weight_version=2)
        multi = sum(len(b) > 1 for b in plan_buckets(separate, 64 << 10))
        assert sender.last_stats["zero_copy_buckets"] == sender.last_stats["buckets"] - multi and multi >= 2
        for url in receivers:
            assert digests(url) == {n: tensor_digest(t) for n, t in separate} and version(url) == "2"


def test_per_tensor_mode_into_an_in_place_receiver(receivers: list[str], tmp_path: Path) -> None:
    """load_format=None: one broadcast per tensor; the in-place receiver writes into its own
    tensors from the second update on (the first creates them); a plain one copies."""
    proc, url = start_receiver(tmp_path, "in_place", 60.0, "--in-place")
    try:
        with WeightSender([EngineTarget(url), EngineTarget(receivers[0])], bucket_bytes=64 << 10,
                          timeout_s=60, load_format=None) as sender:
            for v, seed in ((1, 30), (2, 31)):
                tensors = model_tensors(seed)
                sender.update(tensors, weight_version=v)
                want = {n: tensor_digest(t) for n, t in tensors}
                assert digests(url) == want and digests(receivers[0]) == want
                assert version(url) == version(receivers[0]) == str(v)
    finally:
        proc.stop()


def test_update_outside_session_is_400(receivers: list[str]) -> None:
    body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "headrace_weights"}
    resp = httpx.post(receivers[0] + "/update_weights_from_distributed", json=body, timeout=10)
    assert resp.status_code == 400 and "session" in resp.json()["message"]
    assert httpx.post(receivers[0] + "/end_weight_update", json={}, timeout=10).status_code == 400


def test_per_tensor_broadcast_in_names_order(receivers: list[str]) -> None:
    """load_format None: one broadcast per tensor from rank 0 in names order (SGLang's default)."""
    port, url = free_port(), receivers[0]
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "per_tensor", "backend": "gloo"}
    answer: dict = {}
    t = threading.Thread(target=lambda: answer.update(
        r=httpx.post(url + "/init_weights_update_group", json=init, timeout=60)))
    t.start()
    pg = join_update_group("127.0.0.1", port, 0, 2, "per_tensor", "gloo", 60)
    t.join()
    assert answer["r"].status_code == 200, answer["r"].text
    tensors = model_tensors(20)
    try:
        assert httpx.post(url + "/begin_weight_update", json={}, timeout=10).status_code == 200
        body = {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).split(".")[1] for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "group_name": "per_tensor", "weight_version": "7"}
        t = threading.Thread(target=lambda: answer.update(
            r=httpx.post(url + "/update_weights_from_distributed", json=body, timeout=60)))
        t.start()
        for _, tensor in tensors:
            torch.distributed.broadcast(tensor, src=0, group=pg)
        t.join()
        assert answer["r"].status_code == 200, answer["r"].text
        assert httpx.post(url + "/end_weight_update", json={}, timeout=10).status_code == 200
        got = digests(url)
        assert all(got[n] == tensor_digest(t) for n, t in tensors)
        assert version(url) == "7"
    finally:
        httpx.post(url + "/destroy_weights_update_group", json={"group_name": "per_tensor"}, timeout=30)
        torch.distributed.destroy_process_group(pg)


def test_receiver_rejects_bad_requests() -> None:
    r = WeightReceiver()
    with pytest.raises(RuntimeError, match="init_group"):
        r.receive(["a"], ["float32"], [[1]])
    with pytest.raises(ValueError, match="rank_offset"):
        r.init_group("127.0.0.1", free_port(), 0, 2, "g", "gloo", 5)


def test_engines_from_rollout() -> None:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/v1/engines")
    def engines() -> list[dict]:
        return [{"url": "http://127.0.0.1:1/", "world_size": 2}, {"url": "http://127.0.0.1:2", "world_size": 1}]

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        got = engines_from_rollout(f"http://127.0.0.1:{port}")
        assert got == [EngineTarget("http://127.0.0.1:1", 2), EngineTarget("http://127.0.0.1:2", 1)]
        sender = WeightSender(got)
        assert sender.rank_offsets == [1, 3] and sender.world_size == 4
    finally:
        server.should_exit = True
        th.join(10)
    with pytest.raises(WeightSyncError, match="v1/engines"):
        engines_from_rollout(f"http://127.0.0.1:{free_port()}", timeout_s=2)


# ---- failures ---------------------------------------------------------------------------------

def _killing_after(tensors: list[tuple[str, torch.Tensor]], at: int, action) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(tensors):
        if i == at:
            action()
        yield item


def test_engine_killed_mid_update_is_named(tmp_path: Path) -> None:
    (p0, u0), (p1, u1) = start_receiver(tmp_path, "a"), start_receiver(tmp_path, "b")
    try:
        sender = WeightSender([EngineTarget(u0), EngineTarget(u1)], bucket_bytes=1 << 10, timeout_s=30)
        sender.connect()
        tensors = [(f"w{i}", torch.full((256,), float(i))) for i in range(8)]  # 1 KiB each: one per bucket
        # buckets are pulled one ahead: tensor 3 is pulled after bucket 0 has been delivered
        with pytest.raises(WeightSyncError) as err:
            sender.update(_killing_after(tensors, 3, p1.kill9), weight_version=1)
        assert err.value.urls == [u1] and u1 in str(err.value)
        assert "partially updated" in str(err.value)
        assert version(u0) == "default"  # the survivor holds part of the update, not the new version
        with pytest.raises(WeightSyncError, match="reconnect"):
            sender.update(tensors, weight_version=1)
        with pytest.raises(WeightSyncError) as err:  # destroying the group fails only at the dead engine
            sender.shutdown()
        assert err.value.urls == [u1] and not sender.connected, str(err.value)
    finally:
        p0.stop()
        p1.stop()


def test_hung_engine_times_out_and_is_named(tmp_path: Path) -> None:
    (p0, u0), (p1, u1) = start_receiver(tmp_path, "a"), start_receiver(tmp_path, "b")
    try:
        sender = WeightSender([EngineTarget(u0), EngineTarget(u1)], bucket_bytes=1 << 10, timeout_s=3)
        sender.connect()
        tensors = [(f"w{i}", torch.full((256,), float(i))) for i in range(6)]
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            sender.update(_killing_after(tensors, 3, lambda: os.kill(p0.pid, signal.SIGSTOP)), weight_version=1)
        assert err.value.urls == [u0] and u0 in str(err.value)
        assert time.monotonic() - t0 < 30
        sender._fanout.close()  # no close(): the stopped engine would not answer
    finally:
        os.kill(p0.pid, signal.SIGCONT)
        p0.stop()
        p1.stop()


def test_engine_that_cannot_join_is_named(tmp_path: Path) -> None:
    p0, u0 = start_receiver(tmp_path, "a")
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        sender = WeightSender([EngineTarget(u0), EngineTarget(dead)], timeout_s=10)
        with pytest.raises(WeightSyncError) as err:
            sender.connect()
        assert err.value.urls == [dead]
        assert not sender.connected
        sender._fanout.close()
    finally:
        p0.stop()
