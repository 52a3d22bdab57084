"""``trainer.lora_sync: adapter`` end to end: ``headrace run`` (colocated: buffer, rollout service,
trainer on gloo, as real processes) with LoRA, against a reference engine started here (attached as
an external engine, so it can be asked afterwards what it holds).

After 3 steps: the engine holds exactly the last adapter ``v3`` and weight version "3" (each older
one was unloaded once the next served), the trainer wrote each version's PEFT directory and
deleted all but the last two, the engine's logprobs with ``v3`` differ from the base model's (the
adapters moved), and the rollout logprobs of every step equal the trainer's recomputation of the
same policy (staleness 0: generation named the adapter of the policy that trained on it).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.engine.engine_contract import prompt_ids
from tests.procs import REPO, child_env, free_port, headrace_cmd, reference_engine

STEPS = 3


@pytest.mark.slow
def test_adapter_sync_loads_each_version_and_unloads_the_previous(tiny_model: Path, tmp_path: Path) -> None:
    from headrace.deploy.demo import demo_config_dict

    out = tmp_path / "out"
    sync_root = (out / "lora-sync").resolve()
    with reference_engine(tiny_model, tmp_path / "engine.log", "--allowed-weight-dirs", str(sync_root)) as (url, _):
        c = demo_config_dict(model=str(tiny_model), out=str(out), steps=STEPS, eval_every=0, eval_size=4,
                             placement="colocated")
        c["rollout"].update(groups_per_step=2, n_samples_per_prompt=4, reward="tests.engine.lora_support:parity_reward",
                            engines={"backend": "external", "urls": [url]})
        c["trainer"].update(threads=1, lr=2e-2, lora={"rank": 4, "alpha": 8}, lora_sync="adapter")
        c["buffer"]["port"], c["rollout"]["port"] = free_port(), free_port()
        cfg = tmp_path / "run.yaml"
        cfg.write_text(yaml.safe_dump(c))
        r = subprocess.run(headrace_cmd("run", "--config", str(cfg)), cwd=REPO, env=child_env(), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]

        cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert {c["id"]: c["root"] for c in cards if c["parent"]} == {f"v{STEPS}": str(sync_root / f"v{STEPS}")}
        assert httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == str(STEPS)
        assert sorted(p.name for p in sync_root.iterdir()) == [f"v{STEPS - 1}", f"v{STEPS}"]
        trainer_log = (out / "logs" / "trainer.log").read_text()
        for v in range(1, STEPS + 1):
            assert f"adapter v{v} loaded on 1 engine(s)" in trainer_log, trainer_log[-3000:]

        body = {"input_ids": prompt_ids(4), "return_logprob": True,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
        base = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]["output_token_logprobs"]
        tuned = httpx.post(f"{url}/generate", json={**body, "lora_path": f"v{STEPS}"}, timeout=60).json()
        assert max(abs(a[0] - b[0]) for a, b in zip(base, tuned["meta_info"]["output_token_logprobs"])) > 1e-3

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("loss") is not None]
    assert [row["weight_version"] for row in steps] == list(range(1, STEPS + 1))
    assert all(row["staleness"] == 0 for row in steps)
    assert all(row["rollout_logprob_abs_diff"] < 1e-4 for row in steps), [row["rollout_logprob_abs_diff"] for row in steps]


@pytest.mark.slow
def test_a_load_failing_on_one_engine_names_it_and_leaves_no_mix(tiny_model: Path, tmp_path: Path) -> None:
    """Two external engines under a rollout service with the run token; the second may not read dir B.
    A load from B is a 502 naming that engine, the first engine unloads it again, and generation keeps
    naming the previous adapter; bad bodies are 422 and no token is 401; a restarted service names
    the adapter its engines serve."""
    from tests.engine.lora_support import write_peft_adapter
    from tests.procs import Proc, free_port
    from tests.rollout.support import Stack, write_prompts

    token = "adapter-sync-tok"
    auth = {"Authorization": f"Bearer {token}"}
    a, b = tmp_path / "A", tmp_path / "B"
    for d in (a, b):
        d.mkdir()
        write_peft_adapter(tiny_model, d / "ad")
    engines: list[Proc] = []
    urls = []
    for i, allowed in enumerate(([str(a), "--allowed-weight-dirs", str(b)], [str(a)])):
        port = free_port()
        engines.append(Proc(headrace_cmd("engine", "serve", "--model", str(tiny_model), "--port", str(port),
                                         "--threads", "1", "--allowed-weight-dirs", *allowed),
                            tmp_path / f"engine{i}.log", env=child_env(threads=1, HEADRACE_TOKEN=token)))
        urls.append(f"http://127.0.0.1:{port}")
    stack = Stack(tmp_path / "stack", tiny_model, {
        "mode": "on_demand", "engines": {"backend": "external", "urls": urls},
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 8))}})
    rollout = None
    try:
        for e, u in zip(engines, urls):
            e.wait_http(f"{u}/health", timeout=120)
        stack.start_buffer()
        rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(stack.config), "--port",
                                    str(stack.rollout_port)), tmp_path / "rollout.log",
                       env=child_env(HEADRACE_TOKEN=token))
        rollout.wait_http(f"{stack.url}/health", timeout=240)

        def post(path: str, body: object, headers: dict[str, str] = auth) -> httpx.Response:
            return httpx.post(f"{stack.url}{path}", json=body, headers=headers, timeout=120)

        def listed(u: str) -> set[str]:
            return {c["id"] for c in httpx.get(f"{u}/v1/models", headers=auth, timeout=30).json()["data"] if c["parent"]}

        assert post("/v1/load_adapter", {"path": str(a / "ad"), "weight_version": 1}, {}).status_code == 401
        for bad in ({"path": "", "weight_version": 1}, {"path": str(a / "ad"), "weight_version": "1"},
                    {"path": str(a / "ad"), "weight_version": -1}, {"path": str(a / "ad")},
                    {"path": str(a / "ad"), "weight_version": 1, "name": "x"}, {"path": 3, "weight_version": 1}):
            assert post("/v1/load_adapter", bad).status_code == 422, bad
        r = post("/v1/load_adapter", {"path": str(a / "ad"), "weight_version": 1})
        assert r.status_code == 200 and r.json()["loaded"] == urls, r.text
        assert post("/v1/load_adapter", {"path": str(a / "ad"), "weight_version": 1}).json()["loaded"] == []  # repeatable
        r = post("/v1/resume", {"weight_version": 1})
        assert r.status_code == 200 and r.json()["adapter"] == "v1", r.text

        r = post("/v1/load_adapter", {"path": str(b / "ad"), "weight_version": 2})
        assert r.status_code == 502, r.text
        detail = r.json()["detail"]
        assert list(detail["engines"]) == [urls[1]] and "403" in detail["engines"][urls[1]], detail
        assert urls[1] in detail["message"] and "v2" in detail["message"]
        assert listed(urls[0]) == listed(urls[1]) == {"v1"}          # v2 unloaded again from the first engine
        assert post("/v1/resume", {"weight_version": 2}).json().get("adapter") is None
        status = httpx.get(f"{stack.url}/v1/status", headers=auth, timeout=30).json()
        assert status["adapter"] == "v1"                                 # generation still names v1
        versions = {httpx.get(f"{u}/get_weight_version", headers=auth, timeout=30).json()["weight_version"] for u in urls}
        assert versions == {"1"}

        assert post("/v1/load_adapter", {"path": str(a / "ad"), "weight_version": 2}).status_code == 200
        r = post("/v1/resume", {"weight_version": 2})
        assert r.json()["adapter"] == "v2" and r.json()["adapter_unload_errors"] == {}, r.text
        assert listed(urls[0]) == listed(urls[1]) == {"v2"}
        r = post("/v1/generate_batch", {"groups": 1})
        assert r.status_code == 200, r.text
        # a restarted rollout service names the adapter of the version its engines serve
        rollout.stop()
        rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(stack.config), "--port",
                                    str(stack.rollout_port)), tmp_path / "rollout-2.log",
                       env=child_env(HEADRACE_TOKEN=token))
        rollout.wait_http(f"{stack.url}/health", timeout=240)
        status = httpx.get(f"{stack.url}/v1/status", headers=auth, timeout=30).json()
        assert status["adapter"] == "v2" and status["weight_version"] == 2, status
    finally:
        if rollout is not None:
            rollout.stop()
        stack.stop()
        for e in engines:
            e.stop()
