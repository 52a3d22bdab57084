"""The four services launched separately from the documented commands (not ``headrace run``),
once straight through and once with the rollout service killed (SIGKILL) and restarted in the
middle of the run.

    headrace buffer serve  --port PB --db DB --token-file F
    headrace engine serve  --model M --port PE --token-file F
    headrace rollout serve --config C --port PR --buffer-url http://HOST:PB      (C: engines.backend external, urls [engine])
    headrace train         --config C --buffer-url http://HOST:PB --rollout-url http://HOST:PR

The run token reaches rollout and trainer through ``HEADRACE_TOKEN``; buffer, engine and rollout
service answer 401 without it, and no process's command line holds it. Checked: the run finishes
all steps; the buffer consumed exactly steps x groups_per_step groups; no group is stored twice
(duplicates are counted by the buffer, not stored); every consumed group and every sample uid is
unique; every prompt slot the rollout's cursor marks done is in the buffer (nothing lost by the
crash); no lease is left open.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import Proc, child_env, free_port, headrace_cmd

STEPS = 6
GROUPS = 2
KILL_AFTER_STEP = 2
TOKEN = "s3cret-token"


def _steps_done(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max([r["step"] for r in rows if r.get("loss") is not None], default=0)


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("restart", [
    False,
    True,
], ids=["no-restart", "rollout-kill9-restart"])
def test_separately_launched_services(tmp_path: Path, restart: bool) -> None:
    from headrace.shared.modelzoo import init_model

    model = Path(init_model("tiny-qwen2", tmp_path / "model"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(64)))
    pb, pe, pr = free_port(), free_port(), free_port()
    buffer_url, engine_url, rollout_url = (f"http://127.0.0.1:{p}" for p in (pb, pe, pr))
    out = tmp_path / "run"
    db = tmp_path / "buffer.sqlite"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model),
        "buffer": {"url": buffer_url},
        "rollout": {"engines": {"backend": "external", "urls": [engine_url]},
                    "data": {"path": str(prompts)}, "n_samples_per_prompt": 2, "groups_per_step": GROUPS,
                    "max_concurrency": 4, "sampling": {"temperature": 1.0, "max_new_tokens": 4},
                    "reward": "exact_match", "state_path": str(tmp_path / "rollout_state.json")},
        "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 5, "micro_batch_tokens": 256},
        "run": {"placement": "disaggregated", "out": str(out), "eval_every": 0},
    }))
    env = child_env(HEADRACE_TOKEN=TOKEN)
    logs = tmp_path / "logs"
    rollout_cmd = headrace_cmd("rollout", "serve", "--config", str(config), "--port", str(pr), "--buffer-url", buffer_url)
    procs: list[Proc] = []
    try:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(pb), "--db", str(db), "--token-file", str(token_file)),
                      logs / "buffer.log", env=child_env())
        engine = Proc(headrace_cmd("engine", "serve", "--model", str(model), "--port", str(pe), "--threads", "1",
                                   "--token-file", str(token_file)), logs / "engine.log", env=child_env())
        procs += [buffer, engine]
        buffer.wait_http(f"{buffer_url}/health", 60)
        engine.wait_http(f"{engine_url}/health", 180)
        rollout = Proc(rollout_cmd, logs / "rollout-1.log", env=env)
        procs.append(rollout)
        rollout.wait_http(f"{rollout_url}/health", 120)
        trainer = Proc(headrace_cmd("train", "--config", str(config), "--buffer-url", buffer_url,
                                    "--rollout-url", rollout_url), logs / "trainer.log", env=env)
        procs.append(trainer)

        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while _steps_done(metrics) < KILL_AFTER_STEP:
            assert trainer.alive(), trainer.log()[-4000:]
            assert time.monotonic() < deadline, trainer.log()[-4000:]
            time.sleep(0.2)
        killed_at = _steps_done(metrics)
        if restart:
            rollout.kill9()                      # crash: no shutdown, no final cursor flush
            time.sleep(1.0)
            rollout = Proc(rollout_cmd, logs / "rollout-2.log", env=env)
            procs.append(rollout)
            rollout.wait_http(f"{rollout_url}/health", 120)
        deadline = time.monotonic() + 300
        while trainer.alive():
            # groups evicted as stale are generated but never trained; a few can be (in flight across a
            # sync), a stream of them means the rollout tags groups with a wrong weight version
            assert _stats(buffer_url)["evicted_stale"] <= 4 * GROUPS, _stats(buffer_url)
            assert time.monotonic() < deadline, trainer.log()[-4000:]
            time.sleep(0.5)
        assert trainer.popen.returncode == 0, trainer.log()[-6000:]
        assert killed_at < STEPS, "the rollout restart must happen in the middle of the run"
        assert _steps_done(metrics) == STEPS
        assert rollout.alive(), rollout.log()[-4000:]

        # every service requires the token: without it data endpoints refuse
        assert httpx.post(f"{buffer_url}/v1/leases", json={"n": 1}).status_code == 401
        assert httpx.get(f"{engine_url}/get_model_info").status_code == 401
        assert httpx.get(f"{rollout_url}/v1/status").status_code == 401
        for p in procs:
            if p.alive():
                assert TOKEN.encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
        assert TOKEN not in (out / "trainer_config.yaml").read_text()
        stats = _stats(buffer_url)
        assert stats["consumed"] == STEPS * GROUPS, stats
        assert stats["leased"] == 0, stats
        rollout.stop()                      # graceful: flushes the cursor
        buffer.stop()
    finally:
        for p in reversed(procs):
            p.stop()

    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT group_id, state FROM groups").fetchall()
        uids = [u for (u,) in conn.execute("SELECT uid FROM uids")]
    ids = [g for g, _ in rows]
    assert len(ids) == len(set(ids)), "a group stored twice"
    assert len(uids) == len(set(uids))
    consumed = [g for g, s in rows if s == 2]
    assert len(consumed) == STEPS * GROUPS == len(set(consumed))
    stored_positions = {int(re.search(r"-g(\d+)$", g).group(1)) for g in ids}
    cursor = json.loads((tmp_path / "rollout_state.json").read_text())
    done = set(range(cursor["watermark"])) | set(cursor["done"])
    assert done, cursor
    assert done <= stored_positions, f"prompt slots marked done but missing in the buffer: {sorted(done - stored_positions)}"
    for log in logs.glob("rollout-*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-4000:]
