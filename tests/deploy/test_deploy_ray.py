"""``headrace launch`` on a real local Ray cluster with fake GPU resources (CPU only).

Ray is started in this process with ``num_gpus=N`` (logical GPUs: Ray schedules them like real ones
and hands out ids, but nothing touches CUDA; torch runs on CPU, gloo). What is checked:

- ``deploy.plan.ray_nodes()`` sees the fake GPUs; plans for colocated and disaggregated on 4 and 8
  GPUs place trainer ranks and engine TP ranks on the right bundles, and Ray can actually reserve
  the plan's placement group;
- an infeasible request fails fast with a message naming the config keys, before anything starts;
- a real short run through ``launch_on_ray`` (buffer, a reference engine, rollout service with
  backend external, trainer rank as a Ray actor) completes its steps in both placements.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from headrace.deploy.plan import PlanError, make_plan, ray_nodes
from headrace.shared.config import HeadraceConfig, load_config
from tests.procs import REPO, start_local_ray

ray = pytest.importorskip("ray")

STEPS = 2


def cfg(tp: int, dp: int, trainer: int, rollout: int, engine_tp: int) -> HeadraceConfig:
    return HeadraceConfig.model_validate({"trainer": {"tp": tp, "dp": dp}, "rollout": {"engines": {"tp": engine_tp}},
                                         "run": {"num_gpus": {"trainer": trainer, "rollout": rollout}}})


def _reserve(plan_bundles: int) -> list[str]:
    """Reserve the plan's placement group on Ray, report the GPU id each bundle got, release it."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from headrace.deploy.ray_launch import _Probe

    pg = placement_group([{"GPU": 1, "CPU": 0.1} for _ in range(plan_bundles)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=60)
        Probe = ray.remote(_Probe)
        probes = [Probe.options(num_cpus=0, num_gpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(plan_bundles)]
        gpus = [g for info in ray.get([p.info.remote() for p in probes]) for g in info["gpus"]]
        for p in probes:
            ray.kill(p)
        return gpus
    finally:
        remove_placement_group(pg)


@pytest.mark.slow
def test_plans_on_ray_nodes_with_4_and_8_fake_gpus() -> None:
    for gpus in (4, 8):
        start_local_ray(gpus)
        try:
            nodes = ray_nodes()
            assert len(nodes) == 1 and nodes[0].gpus == gpus, nodes
            if gpus == 4:
                co = make_plan(cfg(2, 2, 4, 4, 2), "colocated", nodes)
                assert [b.processes for b in co.bundles] == [
                    ["trainer:0", "engine:0:tp0"], ["trainer:1", "engine:0:tp1"],
                    ["trainer:2", "engine:1:tp0"], ["trainer:3", "engine:1:tp1"]]
                dis = make_plan(cfg(2, 1, 2, 2, 1), "disaggregated", nodes)
                assert [b.processes for b in dis.bundles] == [["trainer:0"], ["trainer:1"], ["engine:0:tp0"], ["engine:1:tp0"]]
                # 4 GPUs cannot hold trainer 4 + rollout 4 apart: fails before anything is reserved
                with pytest.raises(PlanError, match=r"disaggregated needs 8 GPUs .* cluster has 4"):
                    make_plan(cfg(2, 2, 4, 4, 1), "disaggregated", nodes)
            else:
                co = make_plan(load_config(REPO / "deploy/configs/colocated-8gpu.yaml"), "colocated", nodes)
                assert len(co.bundles) == 8
                assert all(b.processes == [f"trainer:{i}", f"engine:{i // 2}:tp{i % 2}"] for i, b in enumerate(co.bundles))
                dis = make_plan(load_config(REPO / "deploy/configs/disaggregated-4plus4.yaml"), "disaggregated", nodes)
                assert [b.processes for b in dis.bundles] == [[f"trainer:{i}"] for i in range(4)] + \
                    [[f"engine:{e}:tp0"] for e in range(4)]
            for plan in (co, dis):
                assert [b.gpu for b in plan.bundles] == list(range(len(plan.bundles)))
                got = _reserve(len(plan.bundles))   # Ray really grants one distinct GPU per bundle
                assert len(set(got)) == len(plan.bundles), got
        finally:
            ray.shutdown()


def test_infeasible_launch_fails_fast_without_starting_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import headrace.deploy.ray_launch as rl
    from headrace.deploy.ray_launch import launch_on_ray

    start_local_ray(2)
    try:
        c = cfg(1, 2, 2, 2, 1)
        c.run.out = str(tmp_path / "out")
        t0 = time.monotonic()
        with pytest.raises(PlanError, match=r"needs 4 GPUs \(trainer 2, rollout 2\) but the cluster has 2"):
            launch_on_ray(c, "disaggregated")
        with pytest.raises(PlanError, match=r"engines.tp \(2\) must divide run.num_gpus.rollout \(1\)"):
            launch_on_ray(cfg(1, 1, 1, 1, 2), "colocated")
        assert time.monotonic() - t0 < 60   # generous bound: "fast" means no waiting on resources
        # enough GPUs but bundles Ray cannot reserve (4 CPUs per bundle on a 2-CPU cluster): a clear error
        monkeypatch.setattr(rl, "CPUS_PER_BUNDLE", 4)
        monkeypatch.setattr(rl, "PG_TIMEOUT_S", 3.0)
        ok = cfg(1, 1, 1, 1, 1)
        ok.run.out = str(tmp_path / "out")
        with pytest.raises(RuntimeError, match=r"placement group of 2 bundles \{GPU: 1, CPU: 4\} not ready after 3s"):
            launch_on_ray(ok, "disaggregated")
        assert not (tmp_path / "out").exists()
        assert ray.util.placement_group_table() == {} or all(
            p["state"] == "REMOVED" for p in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from headrace.shared.modelzoo import init_model

    return Path(init_model("tiny-qwen2", tmp_path_factory.mktemp("model") / "tiny-qwen2"))


def _run_config(tmp_path: Path, model: Path, placement: str, dp: int, services: int = 1) -> HeadraceConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(32)))
    tree = {
        "model": str(model),
        "buffer": {"max_staleness": 1},
        "rollout": {"engines": {"backend": "reference", "threads": 1, "startup_timeout_s": 240},
                    "data": {"path": str(prompts)}, "n_samples_per_prompt": 2, "groups_per_step": 2,
                    "max_concurrency": 4, "sampling": {"temperature": 1.0, "max_new_tokens": 4}, "reward": "exact_match"},
        "trainer": {"steps": STEPS, "lr": 1e-4, "threads": 1, "lease_wait_s": 10, "micro_batch_tokens": 256, "dp": dp},
        "run": {"placement": placement, "out": str(tmp_path / "run"), "eval_every": 0, "rollout_services": services,
                "num_gpus": {"trainer": dp, "rollout": services}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_config(path)


@pytest.fixture
def ray_3gpus() -> Iterator[None]:
    start_local_ray(3, cpus=3)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("placement, dp, services", [("colocated", 1, 1), ("disaggregated", 2, 1), ("disaggregated", 1, 2)])
def test_short_run_on_ray_completes(tmp_path: Path, model_dir: Path, ray_3gpus: None, placement: str, dp: int,
                                    services: int) -> None:
    """colocated: trainer rank and engine share one bundle (0.5 GPU each), rollout on demand;
    disaggregated: two trainer-rank actors (DP=2, gloo group over MASTER_ADDR/PORT) on two bundles,
    the engine on a third; and one trainer rank with two engines, each driven by its own rollout
    service (``run.rollout_services: 2``: own shard, own config file, both URLs given to the trainer)."""
    from headrace.deploy.ray_launch import launch_on_ray

    c = _run_config(tmp_path, model_dir, placement, dp, services)
    assert launch_on_ray(c, placement) == 0   # type: ignore[arg-type]
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows if r.get("loss") is not None]
    assert steps == list(range(1, STEPS + 1)), rows
    resolved = load_config(out / "config.yaml")
    assert resolved.rollout.engines.backend == "external" and len(resolved.rollout.engines.urls) == services
    assert resolved.rollout.mode == ("on_demand" if placement == "colocated" else "continuous")
    logs = {p.name for p in (out / "logs").iterdir()}
    rollout_logs = {"rollout.log"} if services == 1 else {f"rollout{i}.log" for i in range(services)}
    assert ({"buffer.log"} | rollout_logs | {f"engine{e}.log" for e in range(services)}
            | {f"trainer{r}.log" for r in range(dp)}) <= logs, logs
    if services > 1:   # each service attached to its own engine, with its shard; the trainer drove them all
        shards = [load_config(out / f"rollout{i}.yaml").rollout for i in range(services)]
        assert [(s.data.shard.index, s.data.shard.count) for s in shards] == [(i, services) for i in range(services)]
        assert [s.engines.urls for s in shards] == [[u] for u in resolved.rollout.engines.urls]
        assert [resolved.rollout.url, *resolved.rollout.extra_urls] == [s.url for s in shards]
        text = (out / "logs" / "trainer0.log").read_text()
        assert f"weight-sync group joined by {services} engine(s) of {services} rollout service(s)" in text, text[-3000:]
    for r in range(dp):   # each actor ran exactly one rank of a job of size dp
        text = (out / "logs" / f"trainer{r}.log").read_text()
        assert f"headrace train: done at step {STEPS}" in text, text[-3000:]
    # the placement group is removed and every actor's GPU share is back
    assert all(p["state"] == "REMOVED" for p in ray.util.placement_group_table().values())
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU") != 3.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("GPU") == 3.0, ray.available_resources()
