"""``headrace run`` with several rollout services (``run.rollout_services``), as real processes on
loopback: buffer, two rollout services (each launching one reference engine of the run's two),
trainer.

Checked: the run finishes its steps with evaluations (each over every held-out prompt, split
between the services); each service ran from its own
``<out>/rollout<i>.yaml`` (its shard of the prompts, its port, one engine each, ports counting up
from the run's ``base_port``) and logged to its own file; the trainer drove both (one weight-sync
group over both services' engines, ``rollout.url`` / ``extra_urls`` in config.yaml); the buffer
stored groups of both shards, none twice; the two cursors are per shard and disjoint; ``--resume``
carries on with both shards (still no prompt twice), and is refused with another number of
services. And the
failure before anything starts: more services than engines, or a shard set by hand next to
``run.rollout_services``, is exit 2 naming the keys, nothing written. Cost: ~1-2 min on the 2-core
machine.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.procs import REPO, child_env, free_port, headrace_cmd
from tests.rollout.support import write_prompts

STEPS = 3
GROUPS = 2
PROMPTS = 32


def _config(tmp_path: Path, model: Path, **run: object) -> tuple[Path, Path]:
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS, label=lambda i: str(i + 1))
    out = tmp_path / "run"
    tree = {
        "model": str(model),
        "buffer": {"port": free_port()},
        "rollout": {"port": free_port(), "engines": {"backend": "reference", "count": 2, "base_port": free_port(),
                                                      "threads": 1},
                    "data": {"path": str(prompts), "eval_path": str(prompts)}, "n_samples_per_prompt": 2,
                    "groups_per_step": GROUPS, "max_concurrency": 4, "reward": "exact_match",
                    "sampling": {"temperature": 1.0, "max_new_tokens": 4}},
        "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 5, "micro_batch_tokens": 256},
        "run": {"placement": "colocated", "out": str(out), "eval_every": 2, **run},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path, out


def _headrace_run(config: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(headrace_cmd("run", "--config", str(config)), cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_headrace_run_with_two_rollout_services(tmp_path: Path, tiny_model: Path) -> None:
    config, out = _config(tmp_path, tiny_model, rollout_services=2)
    r = _headrace_run(config, 800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "(rollout on_demand, 2 rollout services)" in r.stdout, r.stdout[:2000]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [x["step"] for x in rows if x.get("loss") is not None] == list(range(1, STEPS + 1))
    assert [x["step"] for x in rows if x.get("eval_score") is not None] == [0, 2, 3]
    assert all(x["eval_n"] == PROMPTS for x in rows if x.get("eval_score") is not None), rows   # both halves
    run_cfg = yaml.safe_load((out / "config.yaml").read_text())
    base = run_cfg["rollout"]["engines"]["base_port"]
    urls = []
    for i in (0, 1):
        sc = yaml.safe_load((out / f"rollout{i}.yaml").read_text())
        assert sc["rollout"]["data"]["shard"] == {"index": i, "count": 2, "weights": [1, 1], "split": True}
        assert sc["rollout"]["engines"]["count"] == 1 and sc["rollout"]["engines"]["base_port"] == base + i
        assert sc["run"]["rollout_services"] == 1
        assert (out / "logs" / f"rollout{i}.log").stat().st_size > 0
        urls.append(sc["rollout"]["url"])
    assert len(set(urls)) == 2
    assert (run_cfg["rollout"]["url"], run_cfg["rollout"]["extra_urls"]) == (urls[0], [urls[1]])
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "weight-sync group joined by 2 engine(s) of 2 rollout service(s)" in trainer_log, trainer_log[-4000:]

    with sqlite3.connect(out / "buffer.sqlite") as db:
        groups = [g for (g,) in db.execute("SELECT group_id FROM groups")]
    slots = [tuple(map(int, re.search(r"-e(\d+)-g(\d+)$", g).groups())) for g in groups]
    assert len(slots) == len(set(slots)) >= STEPS * GROUPS, groups   # no prompt drawn twice
    assert {g % 2 for _, g in slots} == {0, 1}, "both shards' services produced groups"
    cursors = []
    for i in (0, 1):
        cursor = json.loads((out / f"rollout_state.shard{i}of2.json").read_text())
        assert cursor["shard"] == [i, 2]
        cursors.append({g for g in range(cursor["watermark"]) if g % PROMPTS % 2 == i} | set(cursor["done"]))
    assert cursors[0] and cursors[1] and not cursors[0] & cursors[1]
    assert not (out / "rollout_state.json").exists()

    # resumed with two more steps: the same shards carry on from their cursors, no prompt drawn twice
    env = child_env(HEADRACE_TRAINER__STEPS=str(STEPS + 2))
    r = subprocess.run(headrace_cmd("run", "--resume", str(out)), cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [x["step"] for x in rows if x.get("loss") is not None] == list(range(1, STEPS + 3))
    with sqlite3.connect(out / "buffer.sqlite") as db:
        again = [g for (g,) in db.execute("SELECT group_id FROM groups")]
    slots = [tuple(map(int, re.search(r"-e(\d+)-g(\d+)$", g).groups())) for g in again]
    assert len(again) > len(groups) and len(slots) == len(set(slots)), again
    for i in (0, 1):
        assert yaml.safe_load((out / f"rollout{i}.yaml").read_text())["rollout"]["data"]["shard"]["index"] == i
    # resumed with another number of services: refused before anything starts (the cursors are per shard)
    r = subprocess.run(headrace_cmd("run", "--resume", str(out)), cwd=REPO, capture_output=True, text=True,
                       env=child_env(HEADRACE_TRAINER__STEPS=str(STEPS + 4), HEADRACE_RUN__ROLLOUT_SERVICES="1"),
                       timeout=120)
    assert r.returncode == 2 and "run.rollout_services is 1" in r.stderr and "written by 2" in r.stderr, r.stderr


def test_more_rollout_services_than_engines_fails_before_any_process(tmp_path: Path, tiny_model: Path) -> None:
    config, out = _config(tmp_path, tiny_model, rollout_services=3)
    r = _headrace_run(config, 120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "run.rollout_services (3) exceeds the engines (rollout.engines.count = 2)" in r.stderr, r.stderr
    assert not out.exists()

    tree = yaml.safe_load(config.read_text())
    tree["run"]["rollout_services"] = 2
    tree["rollout"]["data"]["shard"] = {"index": 0, "count": 2}
    config.write_text(yaml.safe_dump(tree))
    r = _headrace_run(config, 120)
    assert r.returncode == 2 and "rollout.data.shard" in r.stderr and "run.rollout_services" in r.stderr, r.stderr
    assert not out.exists()


def test_engines_given_by_url_are_split_and_launched_ones_counted(tmp_path: Path) -> None:
    from headrace.deploy.local import engine_split
    from headrace.deploy.plan import rollout_services
    from headrace.shared.config import HeadraceConfig

    urls = [f"http://10.0.0.{i}:30000" for i in range(3)]
    cfg = HeadraceConfig.model_validate({
        "rollout": {"engines": {"backend": "external", "urls": urls}, "port": 8200},
        "run": {"rollout_services": 2, "out": str(tmp_path)}})
    blocks = engine_split(cfg)
    services = rollout_services(cfg, blocks, tmp_path / "config.yaml", lambda: 8201)
    assert [(name, url) for name, url, _ in services] == [("rollout0", "http://127.0.0.1:8200"),
                                                          ("rollout1", "http://127.0.0.1:8201")]
    assert (cfg.rollout.url, cfg.rollout.extra_urls) == ("http://127.0.0.1:8200", ["http://127.0.0.1:8201"])
    written = [yaml.safe_load(file.read_text())["rollout"] for _, _, file in services]
    assert [w["engines"]["urls"] for w in written] == [urls[:2], urls[2:]]
    # a launching backend ignores urls (rollout.fleet launches engines.count): the count is split
    cfg.rollout.engines = cfg.rollout.engines.model_copy(update={"backend": "reference", "count": 5, "base_port": 31000})
    services = rollout_services(cfg, engine_split(cfg), tmp_path / "config.yaml", lambda: 8201)
    written = [yaml.safe_load(file.read_text())["rollout"]["engines"] for _, _, file in services]
    assert [(w["count"], w["base_port"]) for w in written] == [(3, 31000), (2, 31003)]
    # continuous admission: each service's share of the cap follows its engines (3 and 2 of 5)
    shards = [yaml.safe_load(file.read_text())["rollout"]["data"]["shard"] for _, _, file in services]
    assert [(d["index"], d["count"], d["weights"]) for d in shards] == [(0, 2, [3, 2]), (1, 2, [3, 2])]
