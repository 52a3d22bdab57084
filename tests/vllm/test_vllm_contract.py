"""The shared engine contract (tests/engine/engine_contract.py) against a real vLLM 0.32 server on
CPU, reached through Headrace's SGLang-API adapter (``rollout.vllm_backend``), plus the adapter's
own guarantees: bad input is one 400 naming the problem, the run token guards every route but
/health. One vLLM server per module (~1.6 GB RSS, 30-60 s to start), stopped by pid at the end.

Where vLLM differs, the adapter states it and the contract still holds: ``retract`` pauses map to
vLLM's ``keep`` (an abort while so paused answers without ``prompt_tokens``, SGLang's shape for a
request in its waiting queue); /health answers 503 while paused (vLLM's own stays 200).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from tests.engine.engine_contract import EngineContract, generate, post, prompt_ids
from tests.vllm.support import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOKEN = "vllm-contract-token"


@dataclass
class Engine:
    url: str
    model_dir: Path
    log: Path | None = None   # the adapter's and vLLM's log: the contract shows its end when an abort is lost


@pytest.fixture(scope="module")
def vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMEngine]:
    server = VLLMEngine(tiny_model, tmp_path_factory.mktemp("vllm") / "vllm.log", token=TOKEN).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine(vllm: VLLMEngine, tiny_model: Path) -> Iterator[Engine]:
    # the contract's helpers post without a token: send it as httpx's default for this module
    original = httpx.Client.__init__

    def with_token(self: httpx.Client, *a: object, **kw: object) -> None:
        original(self, *a, **kw)
        self.headers["Authorization"] = f"Bearer {TOKEN}"

    mp = pytest.MonkeyPatch()
    mp.setattr(httpx.Client, "__init__", with_token)
    try:
        yield Engine(vllm.url, tiny_model, vllm.log)
    finally:
        mp.undo()


class TestEngineContract(EngineContract):
    """The shared SGLang contract, against this module's vLLM server."""


def test_seed_min_tokens_and_unknown_keys(engine: Engine) -> None:
    sp = {"max_new_tokens": 8, "temperature": 1.0, "seed": 7}
    a = generate(engine, input_ids=prompt_ids(30), sampling_params=sp)["output_ids"]
    b = generate(engine, input_ids=prompt_ids(30), sampling_params=sp)["output_ids"]
    assert a == b
    res = generate(engine, input_ids=prompt_ids(31), sampling_params={"max_new_tokens": 6, "min_new_tokens": 6})
    assert res["meta_info"]["completion_tokens"] == 6
    r = post(engine, "/generate", {"input_ids": prompt_ids(32), "sampling_params": {"max_new_tokens": 2, "bogus": 1}})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    # the body sglang-router 0.3.2 forwards: SGLang's other keys, each at its default
    routed = {"model": None, "input_ids": prompt_ids(33), "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
              "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
              "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}
    r = post(engine, "/generate", routed)
    assert r.status_code == 200 and len(r.json()["meta_info"]["output_token_logprobs"]) == 3, r.text


@pytest.mark.parametrize("body, words", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [[1, 2]], "sampling_params": [{}, {}]}, "2 sampling_params for 1 prompts"),
    ({"sampling_params": {}}, "exactly one of input_ids and text"),
    ({"input_ids": [1, 2], "rid": 5}, "rid"),
    ({"input_ids": [1, 2], "stream": True}, "stream: true is not supported by a vLLM engine here (only false)"),
    ({"input_ids": [1, 2], "return_hidden_states": 1}, "return_hidden_states: 1 is not supported"),
    ({"input_ids": [1, 2], "model": "other"}, 'model: "other" is not supported'),
    ({"input_ids": [1, 2], "session_params": {}}, "unsupported /generate key(s) ['session_params']"),
    ({"input_ids": [1, 2], "lora_path": 5}, "lora_path"),
])
def test_bad_generate_bodies_are_400_naming_the_problem(engine: Engine, body: dict, words: str) -> None:
    r = post(engine, "/generate", body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_bad_weight_and_pause_bodies(engine: Engine) -> None:
    r = post(engine, "/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    r = post(engine, "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]})
    assert r.status_code == 400 and "outside" in r.json()["message"]
    r = post(engine, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x",
                                                     "rank_offset": 1, "world_size": 2})
    assert r.status_code == 400 and "master_port" in r.json()["message"]
    assert post(engine, "/end_weight_update").status_code == 400


def _status(url: str, headers: dict[str, str]) -> int:
    """POST {} with exactly ``headers`` (urllib: the module's httpx clients carry the token)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_token_guards_every_route_but_health(vllm: VLLMEngine) -> None:
    assert httpx.get(f"{vllm.url}/health", timeout=30).status_code == 200
    for path in ("/get_model_info", "/flush_cache", "/generate", "/update_weights_from_distributed", "/nonexistent"):
        assert _status(f"{vllm.url}{path}", {}) == 401, path
    assert _status(f"{vllm.url}/generate", {"Authorization": "Bearer wrong"}) == 401


# ---- weight sync (runs last in this module: it ends with the base weights back) ----------------

PROMPT = [11, 42, 7, 99, 23, 5, 61, 17]


def _sample(url: str, headers: dict) -> tuple[list[int], list[float], str]:
    r = httpx.post(f"{url}/generate", headers=headers, timeout=120, json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    res = r.json()
    return res["output_ids"], [x[0] for x in res["meta_info"]["output_token_logprobs"]], res["meta_info"]["weight_version"]


HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def _upstream(vllm: VLLMEngine) -> str:
    """The vLLM server behind the adapter (its own URL, guarded by the same token)."""
    return httpx.get(f"{vllm.url}/get_server_info", headers=HEADERS, timeout=30).json()["upstream"]


def _upstream_version(upstream: str) -> str:
    return httpx.get(f"{upstream}/weight_info", headers=HEADERS, timeout=30).json()["weight_version"]


def _route_counts(upstream: str) -> dict[tuple[str, str], float]:
    """vLLM's own request counters: (route, status class) -> count."""
    import re

    text = httpx.get(f"{upstream}/metrics", headers=HEADERS, timeout=30).text
    return {(m[1], m[2]): float(m[3]) for m in
            re.finditer(r'^http_requests_total\{handler="([^"]+)",method="POST",status="(\w+)"\} (\S+)$', text, re.M)}


def test_headrace_transfer_engine_refuses_bad_update_info_naming_it(vllm: VLLMEngine) -> None:
    """vLLM's /update_weights hands update_info to Headrace's engine, which names what is wrong; vLLM
    ends the session on the failure (a new one starts) and the served version does not move."""
    up = _upstream(vllm)
    before = _upstream_version(up)
    assert httpx.post(f"{up}/start_weight_update", headers=HEADERS, json={}, timeout=60).status_code == 200
    for info, words in [({"names": ["a"], "dtype_names": ["float33"], "shapes": [[1]]}, "'float33' is not a torch dtype"),
                        ({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}, "dtypes"),
                        ({"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]]}, "differ in length")]:
        r = httpx.post(f"{up}/update_weights", headers=HEADERS, json={"update_info": info}, timeout=60)
        assert r.status_code == 500 and words in r.json()["error"]["message"], r.text
        assert httpx.post(f"{up}/start_weight_update", headers=HEADERS, json={}, timeout=60).status_code == 200
    assert httpx.post(f"{up}/finish_weight_update", headers=HEADERS, json={}, timeout=60).status_code == 200
    assert _upstream_version(up) == before == httpx.get(f"{vllm.url}/get_model_info", headers=HEADERS,
                                                        timeout=30).json()["weight_version"]


def test_weight_sync_tied_model_logprobs_match_and_a_failed_update_is_recovered(vllm: VLLMEngine, tiny_model: Path) -> None:
    """Through vLLM's weight-transfer routes (vLLM's own counters say so, and /collective_rpc is never
    called): vLLM's /weight_info is the version the adapter and every answer report."""
    from headrace.shared.weight_sync import EngineTarget, WeightSender, WeightSyncError
    from tests.vllm.weights import max_diff, perturbed, teacher_forced

    headers, up = HEADERS, _upstream(vllm)
    counts = _route_counts(up)
    base, new = perturbed(tiny_model, seed=None), perturbed(tiny_model, seed=1)
    with WeightSender([EngineTarget(vllm.url)], backend="gloo", bucket_bytes=64 << 10, timeout_s=120,
                      token=TOKEN) as sender:
        sender.update([(n, t.contiguous()) for n, t in new.state_dict().items()], weight_version=1)
        ids, lps, version = _sample(vllm.url, headers)
        assert version == "1" == _upstream_version(up)
        assert max_diff(lps, teacher_forced(new, PROMPT, ids)) < 1e-4      # the tied head is the new one
        assert max_diff(lps, teacher_forced(base, PROMPT, ids)) > 1e-2

        # a failed update (a tensor vLLM cannot load) leaves version 1 serving, whole
        bad = [(n, t.contiguous()) for n, t in base.state_dict().items()] + [("model.nowhere.weight", torch.zeros(3))]
        with pytest.raises(WeightSyncError, match="finish_weight_update.*nowhere"):
            sender.update(bad, weight_version=2)
        ids, lps, version = _sample(vllm.url, headers)
        assert version == "1" == _upstream_version(up) and max_diff(lps, teacher_forced(new, PROMPT, ids)) < 1e-4

        # a full re-push recovers
        sender.reconnect()
        sender.update([(n, t.contiguous()) for n, t in base.state_dict().items()], weight_version=2)
        ids, lps, version = _sample(vllm.url, headers)
        assert version == "2" == _upstream_version(up) and max_diff(lps, teacher_forced(base, PROMPT, ids)) < 1e-4
    after = _route_counts(up)
    grew = {route: after.get((route, "2xx"), 0) - counts.get((route, "2xx"), 0) for route in
            ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
             "/shutdown_weight_transfer_engine")}
    assert all(n >= 2 for n in grew.values()), grew
    assert after.get(("/finish_weight_update", "5xx"), 0) == counts.get(("/finish_weight_update", "5xx"), 0) + 1
    assert {k: n for k, n in after.items() if k[0] == "/collective_rpc"} == \
        {k: n for k, n in counts.items() if k[0] == "/collective_rpc"}, after


def test_an_update_cut_short_is_discarded_and_a_re_push_recovers(vllm: VLLMEngine, tiny_model: Path) -> None:
    """The trainer dies half way through an update (its last bucket, the one carrying the version,
    never comes): ending the session discards what vLLM's engine staged, vLLM keeps serving the base
    weights under its old version, and a full re-push then lands (flattened buckets: one broadcast each)."""
    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from tests.vllm.weights import max_diff, perturbed, teacher_forced

    up = _upstream(vllm)
    served = _upstream_version(up)
    base, new = perturbed(tiny_model, seed=None), perturbed(tiny_model, seed=4)
    items = [(n, t.contiguous()) for n, t in new.state_dict().items()]

    def half_then_die() -> Iterator[tuple[str, torch.Tensor]]:
        yield from items[: len(items) // 2]
        raise RuntimeError("trainer died")

    with WeightSender([EngineTarget(vllm.url)], backend="gloo", bucket_bytes=16 << 10, timeout_s=120,
                      token=TOKEN, load_format="flattened_bucket") as sender:
        with pytest.raises(RuntimeError, match="trainer died"):
            sender.update(half_then_die(), weight_version=5)
        r = httpx.post(f"{vllm.url}/end_weight_update", headers=HEADERS, json={}, timeout=120)
        assert r.status_code == 200 and r.json()["message"] == "incomplete update discarded", r.text
        ids, lps, version = _sample(vllm.url, HEADERS)
        assert version == served == _upstream_version(up) and max_diff(lps, teacher_forced(base, PROMPT, ids)) < 1e-4
        sender.reconnect()
        sender.update(items, weight_version=5)
        ids, lps, version = _sample(vllm.url, HEADERS)
        assert version == "5" == _upstream_version(up) and max_diff(lps, teacher_forced(new, PROMPT, ids)) < 1e-4


def test_the_agent_gateway_on_an_attached_vllm_engine(vllm: VLLMEngine, tiny_model: Path, tmp_path: Path) -> None:
    """The agent gateway on vLLM, unchanged: a buffer and a rollout service (``backend: vllm`` with
    ``engines.urls``: an adapter in front of this module's vLLM server, the module's run token) take
    an external episode driven by the official ``openai`` client: two chat calls around a tool
    result, recorded as one segment token for token with vLLM's logprobs, and the finished episode's
    group reaches the buffer (``tests.rollout.gateway_support.two_turn_tool_episode``, as on SGLang)."""
    from tests.procs import free_port
    from tests.rollout.gateway_support import TokenStack, two_turn_tool_episode, write_tasks

    class VLLMTokenStack(TokenStack):
        token = TOKEN

    st = VLLMTokenStack(tmp_path / "s", tiny_model, {
        "engines": {"backend": "vllm", "urls": [_upstream(vllm)], "base_port": free_port(),
                    "startup_timeout_s": 300, "restart": False},
        "mode": "on_demand", "data": {"path": str(write_tasks(tmp_path / "t.jsonl", 2))},
        "n_samples_per_prompt": 2, "groups_per_step": 2, "sampling": {"max_new_tokens": 6}}).start()
    try:
        two_turn_tool_episode(st, "vllm-1")
    finally:
        st.stop()


def test_a_fleet_attaches_to_a_running_vllm_url_and_syncs_through_it(vllm: VLLMEngine, tiny_model: Path,
                                                                     tmp_path: Path) -> None:
    """``backend: vllm`` with ``engines.urls``: the fleet starts only an adapter (``--upstream``) in
    front of this module's vLLM server, adopts the version vLLM serves, and a weight sync through the
    attached engine moves vLLM's own version (runs last: it leaves version 3 behind)."""
    import asyncio

    from headrace.rollout.fleet import Fleet
    from headrace.shared.config_sections import EnginesConfig
    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from tests.vllm.weights import perturbed

    up = _upstream(vllm)
    served = _upstream_version(up)
    fleet = Fleet(EnginesConfig(backend="vllm", urls=[up], startup_timeout_s=300, restart=False), str(tiny_model),
                  tmp_path, token=TOKEN)

    def sync(url: str) -> None:
        assert httpx.get(f"{url}/get_model_info", headers=HEADERS, timeout=30).json()["weight_version"] == served
        new = perturbed(tiny_model, seed=3)
        with WeightSender([EngineTarget(url)], backend="gloo", timeout_s=120, token=TOKEN) as sender:
            sender.update([(n, t.contiguous()) for n, t in new.state_dict().items()], weight_version=3)
        assert _sample(url, HEADERS)[2] == "3" == _upstream_version(up)

    async def run() -> None:
        await fleet.start()
        try:
            (engine,) = fleet.engines
            assert engine.proc is not None and "--upstream" in engine.proc.args   # no second vLLM
            await asyncio.to_thread(sync, engine.url)
        finally:
            await fleet.stop()

    asyncio.run(run())
    assert httpx.get(f"{up}/health", timeout=30).status_code == 200   # the attached vLLM outlives the fleet
