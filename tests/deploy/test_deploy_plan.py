"""Placement plans (`headrace launch --dry-run`) and the docker compose file, without Ray or Docker."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from headrace.deploy.plan import Node, PlanError, assumed_nodes, engine_blocks, make_plan, service_config
from headrace.shared.config import HeadraceConfig
from tests.procs import REPO, child_env


def cfg(tp: int, dp: int, trainer: int, rollout: int, engine_tp: int) -> HeadraceConfig:
    return HeadraceConfig.model_validate({"trainer": {"tp": tp, "dp": dp}, "rollout": {"engines": {"tp": engine_tp}},
                                         "run": {"num_gpus": {"trainer": trainer, "rollout": rollout}}})


def test_colocated_8_gpus_shares_bundles() -> None:
    plan = make_plan(cfg(2, 4, 8, 8, 2), "colocated", assumed_nodes(8))
    assert len(plan.bundles) == 8
    assert [b.gpu for b in plan.bundles] == list(range(8))
    for i, b in enumerate(plan.bundles):
        assert b.processes == [f"trainer:{i}", f"engine:{i // 2}:tp{i % 2}"]
    assert [e["bundles"] for e in plan.engines] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_disaggregated_4_plus_4_separates_bundles() -> None:
    plan = make_plan(cfg(2, 2, 4, 4, 1), "disaggregated", assumed_nodes(8))
    assert [b.processes for b in plan.bundles[:4]] == [[f"trainer:{i}"] for i in range(4)]
    assert [b.processes for b in plan.bundles[4:]] == [[f"engine:{e}:tp0"] for e in range(4)]


def test_bundles_sorted_by_node_and_gpu_and_engines_stay_on_one_node() -> None:
    nodes = [Node("node-b", 2), Node("node-a", 2)]
    plan = make_plan(cfg(1, 2, 2, 2, 2), "disaggregated", nodes)
    assert [(b.node, b.gpu) for b in plan.bundles] == [("node-a", 0), ("node-a", 1), ("node-b", 0), ("node-b", 1)]
    with pytest.raises(PlanError, match="span nodes"):
        make_plan(cfg(1, 1, 1, 2, 2), "disaggregated", [Node("a", 2), Node("b", 2)])


def test_rollout_services_drive_contiguous_blocks_of_the_engines() -> None:
    assert engine_blocks(7, 3, "x") == [range(0, 3), range(3, 5), range(5, 7)]
    assert engine_blocks(4, 4, "x") == [range(i, i + 1) for i in range(4)]
    assert engine_blocks(5, 1, "x") == [range(0, 5)]
    c = cfg(1, 4, 4, 10, 2)   # five engines of TP 2
    c.run.rollout_services = 2
    plan = make_plan(c, "disaggregated", assumed_nodes(14))
    assert plan.services == ["buffer", "rollout:0", "rollout:1"]
    assert [e["rollout"] for e in plan.engines] == [0, 0, 0, 1, 1]
    assert plan.to_json()["engines"][3] == {"engine": 3, "bundles": [10, 11], "node": "node-0", "rollout": 1}
    assert make_plan(cfg(1, 1, 1, 1, 1), "colocated", assumed_nodes(1)).services == ["buffer", "rollout"]
    c.run.rollout_services = 6
    with pytest.raises(PlanError, match=r"run.rollout_services \(6\) exceeds the engines "
                                        r"\(run.num_gpus.rollout / rollout.engines.tp = 5\)"):
        make_plan(c, "disaggregated", assumed_nodes(14))


def test_service_config_gives_each_service_its_shard_port_and_url() -> None:
    c = cfg(1, 1, 1, 2, 1)
    c.run.rollout_services = 2
    sc = service_config(c, 1, 2, 8301, "http://h:8301")
    assert (sc.rollout.data.shard.index, sc.rollout.data.shard.count, sc.rollout.data.shard.weights) == (1, 2, None)
    assert service_config(c, 1, 2, 8301, "http://h:8301", [3, 1]).rollout.data.shard.weights == [3, 1]
    assert (sc.rollout.port, sc.rollout.url, sc.run.rollout_services) == (8301, "http://h:8301", 1)
    assert c.rollout.data.shard is None and c.run.rollout_services == 2   # the run's config is untouched
    assert service_config(c, 0, 1, 8300, "http://h:8300").rollout.data.shard is None
    with pytest.raises(ValueError, match=r"run.rollout_services is 2 and rollout.data.shard is set"):
        HeadraceConfig.model_validate({"run": {"rollout_services": 2},
                                       "rollout": {"data": {"shard": {"index": 0, "count": 2}}}})
    with pytest.raises(ValueError, match=r"rollout.engines.router_port is 31000: each service starts its own"):
        HeadraceConfig.model_validate({"run": {"rollout_services": 2},
                                       "rollout": {"router": "sglang", "engines": {"router_port": 31000}}})


@pytest.mark.parametrize("c, placement, gpus, match", [
    (cfg(1, 1, 4, 4, 1), "colocated", 4, r"trainer.tp x trainer.dp"),
    (cfg(2, 2, 4, 6, 4), "disaggregated", 16, r"rollout.engines.tp \(4\) must divide"),
    (cfg(2, 2, 4, 4, 1), "disaggregated", 4, r"needs 8 GPUs"),
    (cfg(2, 2, 4, 8, 1), "colocated", 8, r"cannot exceed"),
])
def test_infeasible_requests_fail_with_a_message(c: HeadraceConfig, placement: str, gpus: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        make_plan(c, placement, assumed_nodes(gpus))  # type: ignore[arg-type]


def test_cli_dry_run_prints_json_and_exits_2_when_infeasible(tmp_path: Path) -> None:
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"trainer": {"tp": 2, "dp": 2}, "rollout": {"engines": {"tp": 1}},
                                    "run": {"num_gpus": {"trainer": 4, "rollout": 4}}}))
    base = [sys.executable, "-m", "headrace.deploy.cli", "launch", "--config", str(conf), "--dry-run"]
    ok = subprocess.run(base + ["--placement", "disaggregated", "--assume-gpus", "8"], capture_output=True,
                        text=True, env=child_env(), cwd=REPO, timeout=60)
    assert ok.returncode == 0, ok.stderr
    plan = json.loads(ok.stdout)
    assert plan["placement"] == "disaggregated" and len(plan["bundles"]) == 8
    bad = subprocess.run(base + ["--placement", "disaggregated", "--assume-gpus", "4"], capture_output=True,
                         text=True, env=child_env(), cwd=REPO, timeout=60)
    assert bad.returncode == 2
    assert "needs 8 GPUs" in bad.stderr
    # vLLM engines are placed like SGLang's (one adapter + vLLM per engine); what launch cannot
    # place is refused by key, never replaced by reference engines
    conf.write_text(yaml.safe_dump({"trainer": {"dp": 4}, "rollout": {"engines": {"backend": "vllm", "python": sys.executable}},
                                    "run": {"num_gpus": {"trainer": 4, "rollout": 4}}}))
    vllm = subprocess.run(base + ["--placement", "disaggregated", "--assume-gpus", "8"], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=60)
    assert vllm.returncode == 0, vllm.stdout + vllm.stderr
    assert len(json.loads(vllm.stdout)["engines"]) == 4
    refusals = {
        "rollout.engines.python: backend vllm needs the python of the vLLM venv": {"backend": "vllm"},
        "rollout.engines.urls with backend vllm": {"backend": "vllm", "python": sys.executable,
                                                   "urls": ["http://127.0.0.1:8000"]},
        "rollout.engines.backend external: `headrace launch` places its own engines": {
            "backend": "external", "urls": ["http://127.0.0.1:8000"]},
        "tp 2 with backend vllm: each vLLM engine here is one GPU": {"backend": "vllm", "python": sys.executable,
                                                                    "tp": 2},
    }
    for message, engines in refusals.items():
        conf.write_text(yaml.safe_dump({"rollout": {"engines": engines}}))
        bad = subprocess.run(base + ["--placement", "colocated", "--assume-gpus", "8"], capture_output=True,
                             text=True, env=child_env(), cwd=REPO, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, (engines, bad.stdout + bad.stderr)


# ---- docker compose -------------------------------------------------------------------------

COMPOSE = REPO / "deploy" / "docker-compose.yml"
COMPOSE_GPU = REPO / "deploy" / "docker-compose.gpu.yml"


def _expand(value: str) -> str:
    """Compose interpolation with defaults: ${VAR:-default} -> default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def _check_headrace(args: list[str]) -> dict[str, str]:
    """Run ``headrace ARGS --help`` for real: click rejects unknown commands or flags before --help.

    Returns the command's ``--flag value`` pairs keyed by option name (``buffer_url`` style).
    """
    r = subprocess.run([sys.executable, "-m", "headrace.deploy.cli", *args, "--help"], capture_output=True, text=True,
                       env=child_env(), cwd=REPO, timeout=60)
    assert r.returncode == 0, f"headrace {' '.join(args)}: {r.stderr[-2000:]}"
    flags = {}
    for i, a in enumerate(args):
        if a.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags[a[2:].replace("-", "_")] = args[i + 1]
    return flags


def test_compose_services_are_real_headrace_commands() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert set(services) == {"buffer", "rollout", "trainer"}
    params = {}
    for name, svc in services.items():
        args = [_expand(a) for a in svc["command"]]
        params[name] = _check_headrace(args)
        assert svc["restart"] in ("unless-stopped", "on-failure", "always")
        assert any(v.endswith(":/config/run.yaml:ro") for v in svc["volumes"])
        assert any(v.startswith("headrace-data:") for v in svc["volumes"])
    with pytest.raises(AssertionError, match="No such option"):
        _check_headrace(["buffer", "serve", "--no-such-flag", "1"])
    # ports line up: published port == the port the service binds; peers use the service names
    assert services["buffer"]["ports"] == [f"{params['buffer']['port']}:{params['buffer']['port']}"]
    assert services["rollout"]["ports"] == [f"{params['rollout']['port']}:{params['rollout']['port']}"]
    assert params["rollout"]["buffer_url"] == f"http://buffer:{params['buffer']['port']}"
    assert params["trainer"]["buffer_url"] == f"http://buffer:{params['buffer']['port']}"
    # the trainer shares the rollout container's network (engines are on its 127.0.0.1)
    assert services["trainer"]["network_mode"] == "service:rollout" and "ports" not in services["trainer"]
    assert services["trainer"]["init"] is True and services["trainer"]["stop_grace_period"] == "120s"
    assert params["trainer"]["rollout_url"] == f"http://127.0.0.1:{params['rollout']['port']}"
    for svc in services.values():   # the run token (auth.token) reaches every service in its environment
        assert svc["environment"]["HEADRACE_TOKEN"].startswith("${HEADRACE_TOKEN:?")   # required: they bind 0.0.0.0
        assert not any("token" in str(a).lower() for a in svc["command"])                # never on a command line
    # every service reads the mounted YAML, the buffer too (its buffer.* keys are not lost)
    assert all(params[name]["config"] == "/config/run.yaml" for name in services)
    assert f":{params['buffer']['port']}/health" in " ".join(services["buffer"]["healthcheck"]["test"])
    assert params["buffer"]["db"].startswith("/data/")
    # no GPU reservation in the base file: Docker refuses to start a container whose reservation names
    # a driver the host lacks, so the CPU quick start would fail; the GPU override adds them
    assert not any("deploy" in svc for svc in services.values())
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]
    assert set(gpu) == {"rollout", "trainer"}
    for name, env in (("rollout", "HEADRACE_ROLLOUT_GPUS"), ("trainer", "HEADRACE_TRAINER_GPUS")):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": f"${{{env}:-1}}", "capabilities": ["gpu"]}]
        assert set(gpu[name]) == {"deploy"}   # an override of reservations only
    assert "headrace-data" in doc["volumes"]


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker client not installed")
def test_docker_compose_config_accepts_the_file() -> None:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        r = subprocess.run(["docker", "compose", *(a for f in files for a in ("-f", str(f))), "config", "--quiet"],
                           capture_output=True, text=True,
                           env={**child_env(), "HEADRACE_CONFIG": str(COMPOSE), "HEADRACE_TOKEN": "t"},
                           timeout=60)
        assert r.returncode == 0, r.stderr
