"""``headrace run`` end to end: real buffer, rollout, reference engine and trainer processes on loopback.

Each run is small (tiny-qwen2 straight from ``init_model``, 3-4 GRPO steps of 4 groups x 4 samples,
16 evaluation prompts, one torch thread per process). The untrained model rarely earns a reward, so
these tests check the loop's bookkeeping (steps, versions, files, buffer and data cursor, process
cleanup), not learning; bench/demo_feasibility.py and the README curve cover learning.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from headrace.deploy.supervisor import descendants
from tests.procs import REPO, Proc, child_env, free_port, headrace_cmd

GROUPS, N = 4, 4
ACKED = 2      # buffer/store.py group state of an acknowledged (consumed) group


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model("tiny-qwen2", tmp_path_factory.mktemp("model") / "tiny-qwen2")


def write_config(path: Path, model: Path, out: Path, *, placement: str, steps: int = 3, **run: object) -> Path:
    from headrace.deploy.demo import demo_config_dict

    c = demo_config_dict(model=str(model), out=str(out), steps=steps, eval_every=2, eval_size=16, placement=placement)
    # this worker's ports: two runs starting at once on the defaults could both find a port free
    c["buffer"]["port"], c["rollout"]["port"] = free_port(), free_port()
    c["rollout"]["engines"]["base_port"] = free_port()
    c["rollout"]["groups_per_step"] = GROUPS
    c["rollout"]["n_samples_per_prompt"] = N
    c["run"].update(run)
    c["trainer"]["threads"] = 1
    c["trainer"]["save_every"] = 1
    path.write_text(yaml.safe_dump(c))
    return path


def headrace_run(*args: str, env: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(headrace_cmd("run", *args), cwd=REPO, env=env or child_env(), capture_output=True,
                          text=True, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_rows(out: Path) -> list[dict]:
    return [r for r in metrics(out) if r.get("loss") is not None]


def buffer_groups(out: Path) -> list[tuple[str, int, int]]:
    """(group_id, weight_version, state) of every group the buffer ever stored."""
    with sqlite3.connect(out / "buffer.sqlite") as db:
        return list(db.execute("SELECT group_id, weight_version, state FROM groups ORDER BY seq"))


def check_consistent(out: Path, steps: int) -> None:
    """Steps 1..steps each once, versions follow steps, each data item generated once, steps*GROUPS acked."""
    rows = step_rows(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for key in ("reward_mean", "loss", "approx_kl", "entropy", "samples_per_s"):
            assert isinstance(r[key], (int, float)), (key, r)
        assert r["samples"] == GROUPS * N
        assert 0 <= r["data_weight_version"] <= r["weight_version"] - 1
    groups = buffer_groups(out)
    # a group id is <run id>-e<epoch>-g<position>: the data cursor never hands out an item twice
    items = collections.Counter(gid.split("-", 1)[1] for gid, _, _ in groups)
    assert items and max(items.values()) == 1, items.most_common(3)
    assert sum(1 for _, _, state in groups if state == ACKED) == steps * GROUPS


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_run_then_resume(placement: str, model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", model_dir, out, placement=placement, steps=3)
    token = {"HEADRACE_TOKEN": "run-tok-91c3"} if placement == "colocated" else {}   # one run with the run token
    r = headrace_run("--config", str(cfg), env=child_env(**token))
    assert r.returncode == 0, r.stdout + r.stderr

    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["auth"]["token"] == ("***" if token else None)          # never the token itself
    assert saved["run"]["placement"] == placement
    assert saved["rollout"]["mode"] == ("on_demand" if placement == "colocated" else "continuous")
    rows = metrics(out)
    assert rows[0]["step"] == 0 and "eval_score" in rows[0]            # baseline evaluation
    evals = {r["step"] for r in rows if r.get("eval_score") is not None}
    assert evals == {0, 2, 3}                                           # every 2 steps and the last one
    if placement == "colocated":
        assert all(r["staleness"] == 0 for r in step_rows(out))        # synchronous: always on-policy
    check_consistent(out, 3)
    assert (out / "metrics.png").stat().st_size > 0
    assert (out / "ckpt" / "latest").read_text().strip() == "step_00000003"
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "model.safetensors").is_file()
    assert "eval score" in r.stdout

    # trainer.steps raised through the environment; the merged config is written back
    r = headrace_run("--resume", str(out), env=child_env(HEADRACE_TRAINER__STEPS="4", **token))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming" in r.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["steps"] == 4
    check_consistent(out, 4)
    assert (out / "ckpt" / "latest").read_text().strip() == "step_00000004"
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log and "engines now serve policy version 3" in trainer_log
    if placement == "colocated":
        # on_demand batches are tagged with the version the trainer pushed and resumed with (before
        # any, the one the engines report): 3 means the restored weights were pushed, and every
        # engine confirmed them (WeightSender.update), before generation
        assert step_rows(out)[-1]["data_weight_version"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_sigint_stops_every_child_and_resume_continues(model_dir: Path, tmp_path: Path, sig: int) -> None:
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", model_dir, out, placement="disaggregated", steps=200)
    proc = Proc(headrace_cmd("run", "--config", str(cfg)), tmp_path / "run.log")
    tree: set[tuple[int, int]] = set()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.alive(), proc.log()
            tree |= set(descendants(proc.pid))
            ckpt = out / "ckpt" / "latest"
            if ckpt.is_file() and ckpt.read_text().strip() >= "step_00000002":
                break
            time.sleep(0.5)
        else:
            pytest.fail("no checkpoint at step 2 within 300 s:\n" + proc.log())
        tree |= set(descendants(proc.pid))
        names = {Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                 for pid, _ in tree if Path(f"/proc/{pid}/cmdline").exists()}
        for service in ("buffer serve", "rollout serve", "engine serve", " train "):
            assert any(service in n for n in names), (service, names)
        os.kill(proc.pid, sig)
        assert proc.popen.wait(120) == 130, proc.log()
    finally:
        proc.stop()
    from headrace.deploy.supervisor import _start_time

    # helpers that exit by themselves once their parent is gone (multiprocessing's resource tracker
    # ignores SIGTERM and leaves on EOF) get a few seconds; anything still alive then was left behind
    deadline = time.monotonic() + 15
    while True:
        left = [pid for pid, started in tree if _start_time(pid) == started]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    cmds = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in left
            if Path(f"/proc/{pid}/cmdline").exists()}
    assert not left, f"still running after {signal.Signals(sig).name}: {cmds or left}"
    assert "--resume" in proc.log_path.read_text()     # the message says how to continue

    done = int((out / "ckpt" / "latest").read_text().strip().split("_")[1])
    # the trainer was stopped first (SIGTERM): it checkpointed the last step it finished
    assert done == step_rows(out)[-1]["step"], proc.log_path.read_text()[-4000:]
    if sig == signal.SIGTERM:
        return                                          # the resume below is the same for both signals
    r = headrace_run("--resume", str(out), env=child_env(HEADRACE_TRAINER__STEPS=str(done + 1)))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = step_rows(out)
    assert [x["step"] for x in rows] == list(range(1, done + 2))      # rows past the checkpoint were dropped
    assert rows[-1]["weight_version"] == done + 1
    items = collections.Counter(gid.split("-", 1)[1] for gid, _, _ in buffer_groups(out))
    assert max(items.values()) == 1


def test_bad_config_fails_before_any_process(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", model_dir, out, placement="colocated")
    c = yaml.safe_load(cfg.read_text())
    c["trainer"]["lr"] = -1.0
    cfg.write_text(yaml.safe_dump(c))
    r = headrace_run("--config", str(cfg), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "trainer.lr" in r.stderr
    assert not out.exists()                           # nothing written, no child started

    c["trainer"]["lr"] = 1e-4
    c["run"]["placment"] = "colocated"                # a typo
    cfg.write_text(yaml.safe_dump(c))
    r = headrace_run("--config", str(cfg), timeout=120)
    assert r.returncode == 2 and "run.placment" in r.stderr and "unknown key" in r.stderr

    r = headrace_run("--resume", str(tmp_path / "nowhere"), timeout=120)
    assert r.returncode == 2 and "no config.yaml" in r.stderr
    assert not out.exists()
