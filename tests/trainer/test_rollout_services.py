"""``RolloutServices`` (the trainer's several rollout services as one) and ``EngineControl`` over it,
against real HTTP servers on loopback that answer the rollout control API (no engines, no model):
every phase reaches every service, engines are listed in service order, an engine listed twice
and a failing service are errors naming the service, on-demand batches are split as the services'
engines, a weight-sync failure names the engine and its service, services whose prompt shards
collide are refused when the trainer starts (``headrace train`` against fake services and a real
buffer)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from headrace.shared.config import HeadraceConfig
from headrace.shared.rollout_client import RolloutError
from headrace.shared.weight_sync import WeightSyncError
from headrace.trainer.rollout_control import EngineControl, build_rollout_control
from headrace.trainer.rollout_services import RolloutServices, layout_problems, split_groups


class FakeService:
    """A rollout control API on a free port: records each call; ``fail`` paths answer 500."""

    def __init__(self, engines: list[str]) -> None:
        self.engines, self.calls, self.fail = engines, [], set()
        self.status: dict[str, Any] = {}   # more /v1/status fields (data, mode, admission)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, body: Any, code: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                owner.calls.append(self.path)
                if self.path == "/v1/engines":
                    return self._answer([{"url": u, "world_size": 1} for u in owner.engines])
                self._answer({"weight_version": 0, "engines": [{"url": u, "stale": False} for u in owner.engines],
                              **owner.status})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"null")
                owner.calls.append(f"{self.path} {json.dumps(body, sort_keys=True)}")
                if self.path in owner.fail:
                    return self._answer({"detail": "engine http://e: boom"}, 500)
                if self.path == "/v1/evaluate":   # 10 held-out prompts (or the first n); the even ones pass
                    i, k = body.get("part") or (0, 1)
                    mine = range(i, body.get("n") or 10, k)
                    passed = sum(1 for j in mine if j % 2 == 0) / max(1, len(mine))
                    return self._answer({"n": len(mine), "score": passed, "reward_mean": passed, "failed": i,
                                         "weight_version": 3 + i})
                self._answer({"engines": len(owner.engines)} if self.path == "/v1/load_adapter" else {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def two() -> Iterator[tuple[FakeService, FakeService]]:
    a, b = FakeService(["http://127.0.0.1:7001"]), FakeService(["http://127.0.0.1:7002", "http://127.0.0.1:7003"])
    yield a, b
    a.close()
    b.close()


def test_every_phase_reaches_every_service(two) -> None:
    a, b = two
    rs = RolloutServices([a.url, b.url + "/"])
    try:
        assert [e.url for e in rs.engines()] == a.engines + b.engines          # one group: offsets continue
        assert rs.service_of("http://127.0.0.1:7003") == b.url
        rs.pause("abort")
        rs.resume(3)
        assert rs.load_adapter("/x", 3)["engines"] == 3
        rs.generate_batch(5)                        # 2 + 3, as their engines (1 and 2): the step gets 5
        rs.generate_batch(5, 3)                     # the version the trainer synced goes to every service
        assert [e["service"] for e in rs.status()["engines"]] == [a.url, b.url, b.url]
        ev = rs.evaluate()                         # prompts 0, 2, .. to a (all pass), 1, 3, .. to b (none)
        assert (ev["n"], ev["score"], ev["reward_mean"], ev["failed"], ev["weight_version"]) == (10, 0.5, 0.5, 1, 3)
    finally:
        rs.close()
    posts = lambda s: [c for c in s.calls if c.startswith("/")]              # noqa: E731
    assert posts(a)[1:5] == ['/v1/pause {"mode": "abort"}', '/v1/resume {"weight_version": 3}',
                             '/v1/load_adapter {"path": "/x", "weight_version": 3}', '/v1/generate_batch {"groups": 2}']
    assert '/v1/generate_batch {"groups": 3}' in posts(b)
    assert '/v1/generate_batch {"groups": 2, "weight_version": 3}' in posts(a)
    assert '/v1/generate_batch {"groups": 3, "weight_version": 3}' in posts(b)
    assert '/v1/evaluate {"n": null, "part": [0, 2]}' in a.calls and '/v1/evaluate {"n": null, "part": [1, 2]}' in b.calls
    single = RolloutServices([a.url])
    try:
        assert single.evaluate(4)["n"] == 4                                  # one service: the whole set
    finally:
        single.close()
    assert '/v1/evaluate {"n": 4}' in a.calls


def test_on_demand_groups_follow_each_services_engines(two) -> None:
    """Unequal blocks of engines (5 engines over 2 services: 3 + 2) finish a step together when the
    groups follow the engines; before any engine listing the split lists them first."""
    assert split_groups(7, [3, 2]) == [4, 3] and split_groups(16, [3, 2]) == [10, 6]
    assert split_groups(5, [1, 1]) == [3, 2] and split_groups(1, [1, 2]) == [0, 1]
    assert split_groups(4, [0, 3]) == [0, 4] and split_groups(4, [0, 0]) == [2, 2] and split_groups(0, [1, 1]) == [0, 0]
    a, b = two
    rs = RolloutServices([a.url, b.url])
    try:
        rs.generate_batch(1)            # no listing yet: made now; b has 2 of the 3 engines
    finally:
        rs.close()
    assert "/v1/engines" in a.calls and "/v1/engines" in b.calls
    assert not any(c.startswith("/v1/generate_batch") for c in a.calls)
    assert '/v1/generate_batch {"groups": 1}' in b.calls


def test_a_failing_service_is_named_after_every_service_was_called(two) -> None:
    a, b = two
    b.fail.add("/v1/pause")
    rs = RolloutServices([a.url, b.url])
    try:
        with pytest.raises(RolloutError, match=f"pause failed on 1 of 2 rollout services: rollout service {b.url}: "
                                               ".*500.*boom"):
            rs.pause()
        assert '/v1/pause {"mode": "abort"}' in a.calls
    finally:
        rs.close()


def test_bad_service_lists_are_refused(two) -> None:
    a, b = two
    with pytest.raises(ValueError, match="given twice"):
        RolloutServices([a.url, a.url + "/"])
    with pytest.raises(ValueError, match="at least one"):
        RolloutServices([])
    b.engines = a.engines
    rs = RolloutServices([a.url, b.url])
    try:
        with pytest.raises(RolloutError, match=f"engine http://127.0.0.1:7001 is listed by rollout services {a.url} "
                                               f"and {b.url}"):
            rs.engines()
    finally:
        rs.close()


def test_a_weight_sync_failure_names_the_engine_and_its_service(tmp_path, two, monkeypatch) -> None:
    a, b = two
    cfg = HeadraceConfig.model_validate({"model": str(tmp_path), "trainer": {"sync_timeout_s": 1.0}})
    ctl = build_rollout_control(cfg, SimpleNamespace(rank=0, dp_rank=0, tp=2), [a.url, b.url])
    assert isinstance(ctl, EngineControl) and ctl.rollout.urls == [a.url, b.url]
    ctl.rollout.engines()

    def update(named, version):
        raise WeightSyncError("http://127.0.0.1:7003: connection refused", ["http://127.0.0.1:7003"])

    ctl.sender = SimpleNamespace(connected=True, update=update, close=lambda: None)
    st = SimpleNamespace(policy_version=1, model=SimpleNamespace(hf_state_dict=lambda **kw: iter([("w", None)])))
    with pytest.raises(WeightSyncError, match=f"engine http://127.0.0.1:7003 of rollout service {b.url}"):
        ctl.sync_weights(st)
    ctl.close()


def test_headrace_train_refuses_the_same_rollout_url_twice(tmp_path) -> None:
    import subprocess

    from tests.procs import child_env, headrace_cmd

    (tmp_path / "run.yaml").write_text(f"model: {tmp_path}\n")
    r = subprocess.run(headrace_cmd("train", "--config", str(tmp_path / "run.yaml"), "--rollout-url", "http://h:1",
                                    "--rollout-url", "http://h:1/"), capture_output=True, text=True, env=child_env(),
                       timeout=120)
    assert r.returncode == 2 and "--rollout-url given twice for the same service" in r.stderr, r.stderr


def _st(fingerprint: str, shard: tuple[int, int] | None = None, mode: str = "on_demand", cap: int = 8,
        share: int = 8) -> dict[str, Any]:
    data: dict[str, Any] = {"fingerprint": fingerprint}
    if shard:
        data["shard"] = {"index": shard[0], "count": shard[1]}
    return {"data": data, "mode": mode, "admission_cap": cap, "admission_share": share}


def test_layout_problems_name_colliding_shards_and_warn_of_gaps() -> None:
    urls = ["http://a", "http://b"]
    errors, _ = layout_problems(urls, [_st("f"), _st("f")])
    assert errors == ["rollout services http://a, http://b draw the same prompts (same data, seed and shuffle) but "
                      "http://a, http://b have no rollout.data.shard (or one with split: false), so prompts would be "
                      "generated twice; give each service its own shard {index: i, count: 2}"]
    errors, _ = layout_problems(urls, [_st("f", (0, 2)), _st("f", (0, 2))])
    assert errors == ["rollout services http://a and http://b both draw shard 0 of 2 of the same prompts: give each "
                      "its own rollout.data.shard.index (0..1)"]
    errors, _ = layout_problems(urls, [_st("f", (0, 2)), _st("f", (1, 3))])
    assert len(errors) == 1 and "http://a (count 2), http://b (count 3)" in errors[0] and "same count" in errors[0]
    assert layout_problems(urls, [_st("f", (0, 2)), _st("f")])[0][0].endswith(
        "but http://b has no rollout.data.shard (or one with split: false), so prompts would be generated twice; "
        "give each service its own shard {index: i, count: 2}")
    errors, warnings = layout_problems(urls, [_st("f", (0, 3)), _st("f", (1, 3))])
    assert not errors and len(warnings) == 1 and warnings[0].startswith("shard(s) [2] of 3 of the prompts are drawn by none")
    # different data: nothing to collide; fine as they are, but two continuous services each
    # admitting against the whole cap put up to 2 x cap ahead of the trainer
    assert layout_problems(urls, [_st("f"), _st("g")]) == ([], [])
    errors, warnings = layout_problems(urls, [_st("f", mode="continuous"), _st("g", mode="continuous")])
    assert not errors and len(warnings) == 1 and "admission shares sum to 16, not the cap 8" in warnings[0]
    continuous = [_st("f", (0, 2), "continuous", share=6), _st("f", (1, 2), "continuous", share=2)]
    for st in continuous:
        st["data"]["shard"]["weights"] = [3, 1]
    assert layout_problems(urls, continuous) == ([], [])
    continuous[1]["data"]["shard"]["weights"] = [1, 1]                        # another list there: shares 6 + 4
    continuous[1]["admission_share"] = 4
    errors, warnings = layout_problems(urls, continuous)
    assert errors == ["rollout services http://a ([3, 1]), http://b ([1, 1]) shard the same prompts with different "
                      "rollout.data.shard.weights: give every one the same list (or none), or their admission "
                      "shares do not add up to the cap"]
    assert "sum to 10, not the cap 8" in warnings[0]
    del continuous[1]["data"]["shard"]["weights"]                             # none there: "even"
    assert "http://b (even)" in layout_problems(urls, continuous)[0][0]
    assert layout_problems(urls, [{}, {"data": {}}]) == ([], [])              # services that say nothing


def _own(st: dict[str, Any], run_id: str | None = None) -> dict[str, Any]:
    """``st`` with ``data.shard.split: false`` (and ``run_id``)."""
    st["data"]["shard"]["split"] = False
    if run_id:
        st["run_id"] = run_id
    return st


def test_layout_problems_of_services_over_different_data() -> None:
    """``split: false``: every prompt of its own data, a share of the cap; the same data that way is
    drawn twice; group ids of different data under one run_id collide unless split: false keeps them apart."""
    urls = ["http://a", "http://b"]
    own = [_own(_st("f", (0, 2), "continuous", share=4), "r"), _own(_st("g", (1, 2), "continuous", share=4), "r")]
    assert layout_problems(urls, own) == ([], [])           # one run_id, but keys s0of2-... and s1of2-...
    errors, _ = layout_problems(urls, [_own(_st("f", (0, 2))), _own(_st("f", (1, 2)))])
    assert errors and "have no rollout.data.shard (or one with split: false), so prompts would be generated twice" \
        in errors[0]
    clash = [dict(_st("f"), run_id="r"), dict(_st("g"), run_id="r")]
    errors, _ = layout_problems(urls, clash)
    assert errors == ["rollout services http://a and http://b draw different prompts under the same run_id 'r': "
                      "their group ids (<run_id>-e<epoch>-g<position>) would collide and the buffer would keep only "
                      "one group of each pair; give each its own rollout.state_path (its cursor file, from which the "
                      "default run_id comes) and run_id, or rollout.data.shard {index: i, count: k, split: false}, "
                      "which keeps both apart"]
    clash[1]["run_id"] = "q"
    assert layout_problems(urls, clash) == ([], [])
    split_and_own = [dict(_st("f", (0, 2)), run_id="r"), _own(_st("g", (0, 2)), "r")]   # keys e.. and s0of2-e..
    assert layout_problems(urls, split_and_own) == ([], [])
    twice = [_own(_st("f", (0, 2)), "r"), _own(_st("g", (0, 2)), "r")]              # both s0of2-...
    assert "under the same run_id 'r'" in layout_problems(urls, twice)[0][0]


def test_check_layout_reads_every_service_and_refuses_colliding_shards(two) -> None:
    a, b = two
    a.status = _st("f", (0, 2))
    b.status = _st("f", (0, 2))
    rs = RolloutServices([a.url, b.url])
    try:
        with pytest.raises(RolloutError, match=f"rollout services {a.url} and {b.url} both draw shard 0 of 2"):
            rs.check_layout()
        b.status = _st("f", (1, 2))
        rs.check_layout()
        assert a.calls.count("/v1/status") == 2 and b.calls.count("/v1/status") == 2
    finally:
        rs.close()
    single = RolloutServices([a.url])
    single.check_layout()                    # one service: nothing to compare, no call
    assert a.calls.count("/v1/status") == 2
    single.close()


@pytest.mark.timeout(300)
def test_headrace_train_refuses_services_drawing_the_same_shard(tmp_path, tiny_model, two) -> None:
    """Real ``headrace train`` and ``headrace buffer serve`` processes; the two rollout services are
    fakes reporting shard 0 of 2 of the same prompts: the trainer exits 1 before training, naming them."""
    import subprocess

    from tests.procs import Proc, child_env, free_port, headrace_cmd

    a, b = two
    a.status = b.status = _st("f", (0, 2))
    port = free_port()
    buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(port), "--memory"), tmp_path / "buffer.log")
    try:
        buffer.wait_http(f"http://127.0.0.1:{port}/health", 60)
        (tmp_path / "run.yaml").write_text(f"model: {tiny_model}\nrun: {{out: {tmp_path / 'out'}}}\n")
        r = subprocess.run(headrace_cmd("train", "--config", str(tmp_path / "run.yaml"), "--buffer-url",
                                        f"http://127.0.0.1:{port}", "--rollout-url", a.url, "--rollout-url", b.url),
                           capture_output=True, text=True, env=child_env(), timeout=240)
    finally:
        buffer.stop()
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"rollout services {a.url} and {b.url} both draw shard 0 of 2 of the same prompts" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or "loss" not in (tmp_path / "out" / "metrics.jsonl").read_text()
