"""``headrace launch``: the services on a Ray cluster, placed by ``deploy.plan``.

One placement group of ``{GPU: 1, CPU: k}`` bundles, ordered by node and GPU id (the plan's
order). Every service stays the same command it is everywhere else (``headrace buffer serve``,
``headrace engine serve`` or SGLang, ``headrace rollout serve``, ``headrace train``); a Ray actor
only pins it to its resources and owns its process:

- buffer and rollout service: CPU-only actors pinned to the driver's node; with
  ``run.rollout_services`` k > 1, k rollout services, each attached to its block of the engines
  with its own shard of the prompts (``deploy.plan.rollout_services``, ``<out>/rollout<i>.yaml``),
  and every trainer rank given all their URLs (``--rollout-url`` once per service);
- engines: one actor per engine, on the bundle of its TP rank 0, with CUDA_VISIBLE_DEVICES set to
  the GPU ids Ray gave the engine's bundles; the rollout service attaches to them by URL. For
  ``backend: vllm`` the actor runs Headrace's SGLang-API adapter (``rollout.vllm_backend``), which
  launches vLLM from ``engines.python`` inside the adapter's process group (with a parent-death
  signal), so stopping the actor's process group ends both; ``check_launchable`` refuses by key
  what launch cannot place (backend external, vLLM ``urls``, vLLM without ``engines.python``);
- trainer: one actor per rank on its bundle, torchrun-style env (RANK, WORLD_SIZE, MASTER_ADDR =
  rank 0's node, MASTER_PORT); ``headrace train`` runs that single rank. On several nodes the
  engines join the weight-sync group at rank 0's node (``trainer.sync_address``).

Every actor is stopped (its process group SIGTERM, then SIGKILL) and the placement group removed
when the run ends, fails or is interrupted; a placement group Ray cannot reserve is an error after
``PG_TIMEOUT_S`` naming the bundles and the cluster's resources.

Colocated: trainer ranks and engines share bundles with fractional GPU shares, and the rollout
runs on demand (the synchronous loop releases engine memory while training; ``rollout_mode``
decides). Disaggregated: separate bundles and the asynchronous loop. ``out`` must be on storage every node sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from headrace.deploy.plan import Placement, Plan, engine_blocks, make_plan, ray_nodes, rollout_services
from headrace.rollout.vllm_launch import adapter_command
from headrace.shared.auth import bind_refusal, module_argv, token_env
from headrace.shared.config import ConfigError, HeadraceConfig, rollout_mode, save_config
from headrace.shared.procs import free_port, stop_group, wait_http

CPUS_PER_BUNDLE = 1
PG_TIMEOUT_S = 600.0


class _Service:
    """Body of the Ray actor that owns one service process (defined plain so it imports without ray)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: str, gpu_env: bool = True) -> None:
        import ray

        self.name = name
        full_env = dict(os.environ)
        full_env.update(env)
        full_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        ids = [str(int(i)) for i in ray.get_gpu_ids()] if gpu_env else []
        if "CUDA_VISIBLE_DEVICES" not in env and ids:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full_env, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, grace_s: float = 20.0) -> int | None:
        return stop_group(self.proc, grace_s)


class _Probe:
    """Reports where Ray placed a bundle: node IP and the GPU ids it granted."""

    def info(self) -> dict[str, Any]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "gpus": [str(int(i)) for i in ray.get_gpu_ids()]}


def _wait_http(url: str, actor: Any, timeout_s: float) -> None:
    import ray

    def dead() -> str | None:
        code = ray.get(actor.poll.remote())
        return None if code is None else f"service behind {url} exited with code {code}:\n{ray.get(actor.tail.remote())}"

    try:
        wait_http(url, timeout_s, dead, interval_s=0.5)
    except TimeoutError as e:
        raise TimeoutError(f"{e}:\n{ray.get(actor.tail.remote())}") from None


def check_launchable(cfg: HeadraceConfig) -> None:
    """``ConfigError`` naming the key when ``headrace launch`` cannot place these engines."""
    eng = cfg.rollout.engines
    if eng.backend == "external":
        raise ConfigError("rollout.engines.backend external: `headrace launch` places its own engines; attach to "
                          "running ones with `headrace run` or `headrace rollout serve` instead")
    if eng.backend == "vllm" and eng.urls:
        raise ConfigError("rollout.engines.urls with backend vllm: `headrace launch` places its own vLLM servers "
                          "on the GPUs it reserves; drop the urls (or attach to them with `headrace rollout serve`)")
    if eng.backend == "vllm" and not eng.python:
        raise ConfigError("rollout.engines.python: backend vllm needs the python of the vLLM venv on every node "
                          "(`make vllm-venv` builds .venv-vllm/bin/python)")


def _engine_argv(cfg: HeadraceConfig, host: str, port: int) -> list[str]:
    eng = cfg.rollout.engines
    if eng.backend == "vllm":   # the SGLang-API adapter, which launches vLLM inside its own process group
        return adapter_command(cfg.model, host, port, eng.startup_timeout_s, python=eng.python, args=eng.args)
    if eng.backend == "sglang":   # --api-key is added from the child's HEADRACE_TOKEN, not on its command line
        python = eng.python or sys.executable
        return module_argv(python, "sglang.launch_server", ["--model-path", cfg.model, "--host", host, "--port", str(port),
                                                            "--tp-size", str(eng.tp), *eng.args], cfg.auth.token)
    return [sys.executable, "-m", "headrace.deploy.cli", "engine", "serve", "--model", cfg.model, "--host", host, "--port", str(port), *eng.args]


def launch_on_ray(cfg: HeadraceConfig, placement: Placement, *, dry_run: bool = False) -> int:
    """Connect to RAY_ADDRESS (or start a local Ray), place, run the loop to the end; returns the trainer's exit code."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    check_launchable(cfg)
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False)
    plan: Plan = make_plan(cfg, placement, ray_nodes())
    if dry_run:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    out = Path(cfg.run.out).resolve()
    logs = str(out / "logs")
    pg = placement_group([{"GPU": 1, "CPU": CPUS_PER_BUNDLE} for _ in plan.bundles], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PG_TIMEOUT_S)
    except Exception as e:  # GetTimeoutError: Ray cannot reserve the bundles (e.g. too few CPUs per GPU node)
        remove_placement_group(pg)
        raise RuntimeError(f"placement group of {len(plan.bundles)} bundles {{GPU: 1, CPU: {CPUS_PER_BUNDLE}}} not ready "
                           f"after {PG_TIMEOUT_S:.0f}s ({type(e).__name__}); cluster resources {ray.cluster_resources()}, "
                           f"available {ray.available_resources()}") from None
    share = 0.5 if placement == "colocated" else 1.0
    # buffer and rollout bind an address of the driver's node: pin them there
    driver_node = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)

    def on(bundle: int) -> Any:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

    Service = ray.remote(_Service)
    Probe = ray.remote(_Probe)
    actors: list[Any] = []
    try:
        probes = [Probe.options(num_cpus=0, num_gpus=0.01, scheduling_strategy=on(b.index)).remote() for b in plan.bundles]
        where = ray.get([p.info.remote() for p in probes])
        for p in probes:
            ray.kill(p)
        host = "127.0.0.1" if len({w["ip"] for w in where}) == 1 else ray.util.get_node_ip_address()
        here = ray.util.get_node_ip_address()
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.run.out = str(out)
        run_cfg.buffer.host = host
        run_cfg.buffer.port = free_port("0.0.0.0")
        run_cfg.buffer.url = f"http://{here if host != '127.0.0.1' else host}:{run_cfg.buffer.port}"
        run_cfg.rollout.host = host
        run_cfg.rollout.port = free_port("0.0.0.0")
        run_cfg.rollout.url = f"http://{here if host != '127.0.0.1' else host}:{run_cfg.rollout.port}"
        run_cfg.run.placement = placement
        run_cfg.rollout.mode = rollout_mode(run_cfg)
        if not run_cfg.buffer.memory:
            run_cfg.buffer.db = str(run_cfg.buffer.db or out / "buffer.sqlite")
        refusal = bind_refusal(host, run_cfg.auth.token, False)
        if refusal:
            raise RuntimeError(f"several nodes: the services bind {host}, reachable from other hosts: {refusal}")
        # the buffer reads every buffer.* key from the run's config file (mode 0600; the token there is
        # "***"); rollout and trainer read the file rewritten below. The token reaches every actor's
        # process through its environment only (Ray workers do not inherit the driver's environment).
        secret = token_env(run_cfg.auth.token)
        config_file = save_config(run_cfg, out / "config.yaml")
        buffer = Service.options(num_cpus=0, scheduling_strategy=driver_node).remote(
            "buffer", [sys.executable, "-m", "headrace.deploy.cli", "buffer", "serve", "--config", str(config_file)],
            secret, logs, False)
        actors.append(buffer)
        _wait_http(f"{run_cfg.buffer.url}/health", buffer, 120)

        urls = []
        for e in plan.engines:
            first = e["bundles"][0]
            ip = where[first]["ip"] if host != "127.0.0.1" else host
            port = free_port("0.0.0.0")
            gpu_ids = ",".join(g for b in e["bundles"] for g in where[b]["gpus"])
            argv = _engine_argv(cfg, ip, port)
            actor = Service.options(num_cpus=0, num_gpus=share,
                                    scheduling_strategy=on(first)).remote(
                f"engine{e['engine']}", argv, {"CUDA_VISIBLE_DEVICES": gpu_ids, "OMP_NUM_THREADS": "1", **secret}, logs)
            actors.append(actor)
            urls.append((f"http://{ip}:{port}", actor))
        for url, actor in urls:
            _wait_http(f"{url}/health", actor, cfg.rollout.engines.startup_timeout_s)
        run_cfg.rollout.engines.backend = "external"
        run_cfg.rollout.engines.urls = [u for u, _ in urls]
        if host != "127.0.0.1":   # engines on other nodes join the weight-sync group at trainer rank 0's node
            run_cfg.trainer.sync_address = where[0]["ip"]
        config_file = save_config(run_cfg, out / "config.yaml")

        # one rollout service per block of the plan's engines (``Plan.engines[].rollout``)
        k = cfg.run.rollout_services
        services = rollout_services(run_cfg, engine_blocks(len(urls), k, "run.num_gpus.rollout / rollout.engines.tp"),
                                    config_file, lambda: free_port("0.0.0.0"))
        if k > 1:   # the run's config names the services the trainer drives
            config_file = save_config(run_cfg, out / "config.yaml")
        rollouts = []   # (name, URL, actor)
        for name, url, file in services:
            actor = Service.options(num_cpus=0, scheduling_strategy=driver_node).remote(
                name, [sys.executable, "-m", "headrace.deploy.cli", "rollout", "serve", "--config", str(file)],
                secret, logs, False)
            actors.append(actor)
            rollouts.append((name, url, actor))
        for _, url, actor in rollouts:
            _wait_http(f"{url}/health", actor, 300)
        rollout_urls = [a for _, url, _ in rollouts for a in ("--rollout-url", url)]

        master = where[0]["ip"] if host != "127.0.0.1" else "127.0.0.1"
        master_port = str(free_port("0.0.0.0"))
        world = plan.trainer["world_size"]
        trainers = []
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": master,
                   "MASTER_PORT": master_port, "OMP_NUM_THREADS": str(cfg.trainer.threads or 1), **secret}
            t = Service.options(num_cpus=0, num_gpus=share,
                                scheduling_strategy=on(rank)).remote(
                f"trainer{rank}", [sys.executable, "-m", "headrace.deploy.cli", "train", "--config", str(config_file),
                                   *rollout_urls], env, logs)
            trainers.append(t)
            actors.append(t)
        while True:
            codes = ray.get([t.poll.remote() for t in trainers])
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                raise RuntimeError(f"trainer rank {r} exited with code {c}:\n{ray.get(trainers[r].tail.remote())}")
            if all(c == 0 for c in codes):
                return 0
            for name, _, a in [("buffer", "", buffer), *rollouts]:
                c = ray.get(a.poll.remote())
                if c is not None:
                    raise RuntimeError(f"{name} exited with code {c}:\n{ray.get(a.tail.remote())}")
            time.sleep(1.0)
    finally:
        for a in reversed(actors):
            try:
                ray.get(a.stop.remote(), timeout=60)
            except Exception:  # an actor that already died has nothing left to stop
                pass
            ray.kill(a)
        remove_placement_group(pg)
