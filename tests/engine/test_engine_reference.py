"""The reference engine as a real ``headrace engine serve`` process on loopback.

Runs the SGLang contract (tests/engine/engine_contract.py) against it, plus reference-only checks:
continuous batching, memory release/resume, weight updates from disk, the weight-update session
rule, seeded sampling, and bad input answered with a clear 4xx while the server keeps serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.engine.engine_contract import Background, EngineContract, generate, hf_logprobs, post, prompt_ids
from tests.procs import Proc, child_env, headrace_cmd, reference_engine


@dataclass
class EngineHandle:
    url: str
    model_dir: str
    proc: Proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model("tiny-qwen2", tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    # weights from other directories of this session (tmp_path) may be loaded from disk
    with reference_engine(model_dir, tmp_path_factory.mktemp("logs") / "engine.log",
                          "--allowed-weight-dirs", str(tmp_path_factory.getbasetemp())) as (url, proc):
        yield EngineHandle(url, str(model_dir), proc)


class TestEngineContract(EngineContract):
    """The shared SGLang contract, against this module's reference engine."""


def server_state(engine: EngineHandle) -> dict:
    return httpx.get(f"{engine.url}/get_server_info", timeout=30).json()["internal_states"][0]


def greedy(engine: EngineHandle, k: int = 0, n: int = 12) -> list[int]:
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    return generate(engine, input_ids=prompt_ids(k), sampling_params=sp)["output_ids"]


def test_a_request_sent_while_another_runs_joins_and_completes(engine: EngineHandle) -> None:
    long = Background(engine, input_ids=prompt_ids(30), rid="cb-long",
                      sampling_params={"max_new_tokens": 1800, "ignore_eos": True})
    try:
        deadline = time.monotonic() + 60
        while server_state(engine)["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not long.done(), "the long request finished before the test could overlap it"
        short = generate(engine, input_ids=prompt_ids(31), sampling_params={"max_new_tokens": 5, "ignore_eos": True})
        assert short["meta_info"]["completion_tokens"] == 5
        assert not long.done(), "the short request waited for the long one (no continuous batching)"
    finally:
        post(engine, "/abort_request", {"rid": "cb-long"})
    assert long.wait()["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_client_that_goes_away_aborts_its_request(engine: EngineHandle) -> None:
    body = {"input_ids": prompt_ids(41), "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}}
    generated = server_state(engine)["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/generate", json=body, timeout=httpx.Timeout(30.0, read=1.0))
    deadline = time.monotonic() + 60
    while server_state(engine)["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    st = server_state(engine)
    assert st["running"] == 0
    assert st["generated_tokens"] - generated < 1800, "the request ran to the end instead of being aborted"


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine: EngineHandle) -> None:
    sp = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    alone = generate(engine, input_ids=prompt_ids(32), sampling_params=sp)["output_ids"]
    again = generate(engine, input_ids=prompt_ids(32), sampling_params=sp)["output_ids"]
    batch = generate(engine, input_ids=[prompt_ids(33), prompt_ids(32)],
                     sampling_params=[{**sp, "sampling_seed": 99}, sp])
    assert alone == again == batch[1]["output_ids"]


def test_release_and_resume_memory(engine: EngineHandle) -> None:
    before = greedy(engine, 34)
    r = post(engine, "/release_memory_occupation", {})
    assert r.status_code == 200, r.text
    st = server_state(engine)
    assert st["released"] == ["kv_cache", "weights"]
    assert st["weights_bytes"] == 0 and st["kv_cache_bytes"] == 0
    bad = post(engine, "/generate", {"input_ids": prompt_ids(34)})
    assert bad.status_code == 503 and "resume_memory_occupation" in bad.json()["error"]["message"]
    assert post(engine, "/resume_memory_occupation", {}).status_code == 200
    st = server_state(engine)
    assert st["released"] == [] and st["weights_bytes"] > 0
    assert greedy(engine, 34) == before


def test_release_kv_cache_retracts_running_requests_without_losing_tokens(engine: EngineHandle) -> None:
    bg = Background(engine, input_ids=prompt_ids(35), sampling_params={"max_new_tokens": 300, "ignore_eos": True})
    deadline = time.monotonic() + 60
    while server_state(engine)["running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert post(engine, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
        assert server_state(engine)["kv_cache_bytes"] == 0
    finally:
        assert post(engine, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    res = bg.wait()
    assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


def test_update_weights_from_disk(engine: EngineHandle, model_dir: Path, tmp_path: Path) -> None:
    from headrace.shared.modelzoo import init_model

    other = init_model("tiny-qwen2", tmp_path / "other", seed=1)
    before = greedy(engine, 36)
    r = post(engine, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "7"})
    assert r.status_code == 200 and r.json()["success"], r.text
    info = httpx.get(f"{engine.url}/get_model_info", timeout=30).json()
    assert info["weight_version"] == "7"
    res = generate(engine, input_ids=prompt_ids(36), return_logprob=True,
                   sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    assert res["meta_info"]["weight_version"] == "7"
    ref = hf_logprobs(str(other), prompt_ids(36), res["output_ids"])
    assert res["output_ids"][0] == int(ref[0].argmax())
    assert abs(res["meta_info"]["output_token_logprobs"][0][0] - float(ref[0].max())) < 1e-3
    r = post(engine, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "default"})
    assert r.status_code == 200, r.text
    assert greedy(engine, 36) == before


def test_update_weights_from_disk_bad_path_is_400_and_changes_nothing(engine: EngineHandle, tmp_path: Path) -> None:
    before = greedy(engine, 37)
    r = post(engine, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and r.json()["success"] is False and "missing" in r.json()["message"]
    assert greedy(engine, 37) == before


def test_weight_update_session_rules(engine: EngineHandle) -> None:
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]]}
    r = post(engine, "/update_weights_from_distributed", body)
    assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]
    assert post(engine, "/end_weight_update").status_code == 400
    assert post(engine, "/begin_weight_update").status_code == 200
    try:
        assert post(engine, "/begin_weight_update").status_code == 400
        r = post(engine, "/update_weights_from_distributed", body)      # in a session, but no group
        assert r.status_code == 400 and "init_weights_update_group" in r.json()["message"]
    finally:
        assert post(engine, "/end_weight_update").status_code == 200
    assert len(greedy(engine, 38, 3)) == 3


@pytest.mark.parametrize("body, needle", [
    ({}, "text or input_ids"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 2], "text": "x"}, "not both"),
    ({"input_ids": [1, 10 ** 7]}, "outside the vocabulary"),
    ({"input_ids": ["a"]}, "list of integers"),
    ({"input_ids": [1], "sampling_params": {"temprature": 1.0}}, "unknown field"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10 ** 6}}, "context length"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "not supported"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "list of 1"),
])
def test_bad_input_is_a_clear_400_and_the_server_keeps_serving(engine: EngineHandle, body: dict, needle: str) -> None:
    r = post(engine, "/generate", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert len(greedy(engine, 39, 2)) == 2


def test_invalid_json_and_bad_control_bodies(engine: EngineHandle) -> None:
    r = httpx.post(f"{engine.url}/generate", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert post(engine, "/pause_generation", {"mode": "sideways"}).status_code == 400
    assert post(engine, "/release_memory_occupation", {"tags": ["gpu"]}).status_code == 400
    assert post(engine, "/init_weights_update_group", {"master_address": "127.0.0.1"}).status_code == 400
    assert len(greedy(engine, 40, 2)) == 2


def test_get_weights_by_name_and_server_info(engine: EngineHandle) -> None:
    w = post(engine, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4}).json()
    assert w == [1.0, 1.0, 1.0, 1.0]                   # RMSNorm weights of a random-init preset
    assert post(engine, "/get_weights_by_name", {"name": "nope"}).status_code == 400
    info = httpx.get(f"{engine.url}/get_server_info", timeout=30).json()
    assert info["weight_version"] == "default" and info["internal_states"][0]["paused"] is None


def test_serve_refuses_a_directory_without_a_model(tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run(headrace_cmd("engine", "serve", "--model", str(tmp_path)), capture_output=True, text=True,
                       env=child_env(), timeout=120)
    assert r.returncode != 0
    assert "--model" in r.stderr and "no config.json" in r.stderr


def _wait_running(engine: EngineHandle, n: int = 1) -> None:
    deadline = time.monotonic() + 60
    while server_state(engine)["running"] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server_state(engine)["running"] >= n


def test_flush_cache_is_refused_while_requests_hold_cache_in_place(engine: EngineHandle) -> None:
    bg = Background(engine, input_ids=prompt_ids(42), rid="flush-hold",
                    sampling_params={"max_new_tokens": 1800, "ignore_eos": True})
    _wait_running(engine)
    assert post(engine, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        assert post(engine, "/flush_cache").status_code == 400
    finally:
        assert post(engine, "/continue_generation").status_code == 200
        post(engine, "/abort_request", {"rid": "flush-hold"})
    assert bg.wait()["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(engine, "/flush_cache").status_code == 200


def test_abort_by_request_rid_reaches_all_n_samples(engine: EngineHandle) -> None:
    bg = Background(engine, input_ids=prompt_ids(43), rid="group-7",
                    sampling_params={"n": 3, "max_new_tokens": 1800, "ignore_eos": True})
    _wait_running(engine, 3)
    assert post(engine, "/abort_request", {"rid": "group-7"}).status_code == 200
    res = bg.wait()
    assert [r["meta_info"]["id"] for r in res] == ["group-7_0", "group-7_1", "group-7_2"]
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in res)
