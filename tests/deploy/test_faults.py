"""The fault test of issue 14: the four services from their separate commands (README "Run the
services separately"), 30 steps of the tiny recipe, and during the run kill -9 and restart of the
buffer (twice; the trainer always holds leases then), the rollout service, the engine and the
trainer (between checkpoints: save_every 5). Then DESIGN.md's invariant:

- consumed groups == final step x groups_per_step, every consumed group id distinct (the database's
  own rows), none dead-lettered;
- none lost: every group the buffer stored is consumed, queued, dead-lettered or evicted as stale;
  nothing leased or held at the end.

It prints the counts for the issue's closing note (produced, consumed, duplicates refused, replayed
after the trainer kill, dead-lettered, lost).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import Proc, child_env, free_port, headrace_cmd

STEPS, GROUPS, SAVE_EVERY = 30, 2, 5
TOKEN = "fault-test-token"
# (after this many steps, which service is killed with SIGKILL and restarted)
FAULTS = [(3, "buffer"), (7, "rollout"), (SAVE_EVERY * 2 + 2, "trainer"), (17, "buffer"), (22, "engine")]


def _rows(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _steps_done(metrics: Path) -> int:
    return max([r["step"] for r in _rows(metrics) if r.get("loss") is not None], default=0)


def _diagnosis(procs: dict, rollout_url: str, phase: str) -> str:
    """What a stalled run looks like from outside: every log's tail, then the rollout's status and
    the phase last (a report that keeps only the end of a long message keeps those)."""
    try:
        status = httpx.get(f"{rollout_url}/v1/status", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).text
    except httpx.HTTPError as e:
        status = f"unreachable: {e}"
    tails = "\n".join(f"--- {name} ---\n{p.log()[-2500:]}" for name, p in procs.items())
    alive = ", ".join(f"{name} {'alive' if p.alive() else f'exited {p.popen.returncode}'}" for name, p in procs.items())
    return f"{tails}\nrollout /v1/status: {status[:3000]}\nprocesses: {alive}\nSTALLED {phase}"


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill9_of_every_service_keeps_exactly_once(tmp_path: Path) -> None:
    from headrace.shared.modelzoo import init_model

    model = Path(init_model("tiny-qwen2", tmp_path / "model"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(256)))
    pb, pe, pr = free_port(), free_port(), free_port()
    buffer_url, engine_url, rollout_url = (f"http://127.0.0.1:{p}" for p in (pb, pe, pr))
    out, db, logs = tmp_path / "run", tmp_path / "buffer.sqlite", tmp_path / "logs"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model),
        "buffer": {"url": buffer_url, "lease_s": 20},
        "rollout": {"engines": {"backend": "external", "urls": [engine_url]},
                    "data": {"path": str(prompts)}, "n_samples_per_prompt": 2, "groups_per_step": GROUPS,
                    "max_concurrency": 4, "sampling": {"temperature": 1.0, "max_new_tokens": 4},
                    "reward": "exact_match", "state_path": str(tmp_path / "rollout_state.json")},
        "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 5, "micro_batch_tokens": 256,
                    "save_every": SAVE_EVERY, "sync_timeout_s": 60},
        "run": {"placement": "disaggregated", "out": str(out), "eval_every": 0},
    }))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = child_env(HEADRACE_TOKEN=TOKEN)
    cmds = {
        "buffer": headrace_cmd("buffer", "serve", "--port", str(pb), "--db", str(db), "--token-file", str(token_file)),
        "engine": headrace_cmd("engine", "serve", "--model", str(model), "--port", str(pe), "--threads", "1",
                               "--token-file", str(token_file)),
        "rollout": headrace_cmd("rollout", "serve", "--config", str(config), "--port", str(pr),
                                "--buffer-url", buffer_url),
        "trainer": headrace_cmd("train", "--config", str(config), "--buffer-url", buffer_url,
                                "--rollout-url", rollout_url),
    }
    health = {"buffer": f"{buffer_url}/health", "engine": f"{engine_url}/health", "rollout": f"{rollout_url}/health"}
    started: dict[str, int] = {}
    procs: dict[str, Proc] = {}
    every: list[Proc] = []

    def start(name: str) -> None:
        started[name] = started.get(name, 0) + 1
        p = Proc(cmds[name], logs / f"{name}-{started[name]}.log", env=env if name in ("rollout", "trainer") else child_env())
        procs[name] = p
        every.append(p)
        if name in health:
            p.wait_http(health[name], 180)

    metrics = out / "metrics.jsonl"
    replayed = 0
    try:
        for name in ("buffer", "engine", "rollout", "trainer"):
            start(name)
        for after, name in FAULTS:
            deadline = time.monotonic() + 300   # at most 5 steps per phase: a stall, not slowness, beyond it
            while _steps_done(metrics) < after:
                assert procs["trainer"].alive(), procs["trainer"].log()[-6000:]
                assert time.monotonic() < deadline, _diagnosis(
                    procs, rollout_url, f"before killing the {name} after step {after}: {_steps_done(metrics)} steps done")
                time.sleep(0.2)
            procs[name].kill9()
            if name == "trainer":
                trained = len(_rows(metrics))
                saved = int((out / "ckpt" / "latest").read_text().removeprefix("step_"))
                assert saved < trained, "the trainer kill must fall between checkpoints"
                replayed = (trained - saved) * GROUPS
            time.sleep(1.0)
            start(name)
        deadline = time.monotonic() + 600
        while procs["trainer"].alive():
            assert time.monotonic() < deadline, _diagnosis(
                procs, rollout_url, f"after the last fault: {_steps_done(metrics)} of {STEPS} steps done")
            time.sleep(0.5)
        assert procs["trainer"].popen.returncode == 0, procs["trainer"].log()[-6000:]
        assert _steps_done(metrics) == STEPS
        stats = _stats(buffer_url)
        for name in ("rollout", "engine", "buffer"):
            procs[name].stop()
    finally:
        for p in reversed(every):
            p.stop()

    with sqlite3.connect(db) as conn:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
        consumed = [g for (g,) in conn.execute("SELECT group_id FROM groups WHERE state = 2")]
        produced = conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0]
        dead = conn.execute("SELECT COUNT(*) FROM dead_letters").fetchone()[0]
        open_leases = conn.execute("SELECT COUNT(*) FROM leases WHERE state = 0").fetchone()[0]
    assert len(consumed) == STEPS * GROUPS == len(set(consumed)) == stats["consumed"], (states, stats)
    assert dead == 0 and stats["dead_lettered"] == 0
    assert (stats["leased"], stats["held"], open_leases) == (0, 0, 0), stats
    lost = produced - sum(states.get(s, 0) for s in (0, 2, 3, 4))     # queued, consumed, evicted, dead-lettered
    assert lost == 0, states
    print(f"\nfault test: produced {produced}, consumed {len(consumed)}, duplicates refused {stats['duplicates']}, "
          f"replayed after the trainer kill {replayed}, evicted stale {states.get(3, 0)}, queued at the end "
          f"{states.get(0, 0)}, dead-lettered {dead}, lost {lost}; restarts {started}")
