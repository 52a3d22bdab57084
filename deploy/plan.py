"""Placement plans: which GPU bundle holds which trainer rank and engine TP rank.

A plan is pure data computed from the run config and a list of nodes (GPUs per node); it starts
nothing (``rollout_services`` only writes the services' config files), so ``headrace launch
--dry-run`` and the Ray launcher share it. Guarantees:

- bundles are ordered by node, then GPU id; every bundle is one GPU;
- colocated: trainer ranks and engines share the same bundles (engine e, TP rank r lives on bundle
  ``e * rollout.engines.tp + r``); disaggregated: trainer bundles come first, rollout bundles after them;
- an engine's TP ranks never span two nodes, trainer world = ``tp x dp`` = ``run.num_gpus.trainer``;
- anything infeasible raises ``PlanError`` naming the config keys involved, before anything starts;
- ``run.rollout_services`` k > 1: the engines are split into k contiguous blocks whose sizes differ
  by at most one (``engine_blocks``), engine e is driven by the service whose block holds it (its
  ``"rollout"`` index in the plan), the services are ``rollout:0`` .. ``rollout:k-1``; each service
  runs with ``service_config``: its own shard of the prompts (``rollout.data.shard {i, k}``, hence
  its own cursor file), port and URL. ``headrace run`` splits its engines the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from headrace.shared.config import HeadraceConfig, ShardConfig, save_config

Placement = Literal["colocated", "disaggregated"]


class PlanError(ValueError):
    """The requested placement cannot be satisfied."""


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int


@dataclass
class Bundle:
    index: int
    node: str
    gpu: int
    processes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    placement: Placement
    bundles: list[Bundle]
    trainer: dict[str, int]
    engines: list[dict[str, Any]]
    services: list[str] = field(default_factory=lambda: ["buffer", "rollout"])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _slots(nodes: list[Node]) -> list[tuple[str, int]]:
    return [(n.name, g) for n in sorted(nodes, key=lambda n: n.name) for g in range(n.gpus)]


def engine_blocks(engines: int, services: int, what: str) -> list[range]:
    """The engine indices each of ``services`` rollout services drives: contiguous blocks, sizes
    differing by at most one. ``what`` names where the engine count comes from, for the error."""
    if services > engines:
        raise PlanError(f"run.rollout_services ({services}) exceeds the engines ({what} = {engines}): "
                        "every rollout service needs at least one engine")
    size, extra = divmod(engines, services)
    starts = [i * size + min(i, extra) for i in range(services + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(services)]


def service_config(cfg: HeadraceConfig, index: int, count: int, port: int, url: str,
                   weights: list[int] | None = None) -> HeadraceConfig:
    """The config rollout service ``index`` of ``count`` runs with: a copy of the run's, with its
    shard of the prompts and, with ``weights`` (the services' engine counts), of the continuous
    admission cap (no shard when ``count`` is 1), its port and its URL; the caller sets its engines."""
    c = cfg.model_copy(deep=True)
    c.run.rollout_services = 1
    c.rollout.data.shard = ShardConfig(index=index, count=count, weights=weights) if count > 1 else None
    c.rollout.port = port
    c.rollout.url = url
    return c


def attached(cfg: HeadraceConfig) -> bool:
    """The rollout attaches to ``rollout.engines.urls`` (external engines, or vLLM servers given by
    URL) rather than launching ``rollout.engines.count`` engines (as ``rollout.fleet`` decides)."""
    eng = cfg.rollout.engines
    return eng.backend == "external" or (eng.backend == "vllm" and bool(eng.urls))


def rollout_services(cfg: HeadraceConfig, blocks: list[range], config_file: Path,
                     free_port: Callable[[], int]) -> list[tuple[str, str, Path]]:
    """(name, URL, config file) of each rollout service of a run whose engines ``blocks`` splits.
    One block: ``("rollout", rollout.url, config_file)``, the run's own config. Several: service i
    is ``rollout<i>`` with ``<run.out>/rollout<i>.yaml`` (written here, ``service_config``) holding
    its block of ``rollout.engines.urls`` where the rollout attaches to them, else its share of
    ``count`` with the ports from ``base_port`` on, and shares of the admission cap in proportion to
    their engines (``shard.weights``); service 0 keeps ``rollout.port``, the others get
    ``free_port()``; ``cfg.rollout.extra_urls`` is set to the others' URLs (the caller saves ``cfg``)."""
    if len(blocks) == 1:
        return [("rollout", cfg.rollout.url, config_file)]
    eng, out = cfg.rollout.engines, []
    for i, block in enumerate(blocks):
        port = cfg.rollout.port if i == 0 else free_port()
        sc = service_config(cfg, i, len(blocks), port, f"http://{cfg.rollout.host}:{port}", [len(b) for b in blocks])
        if attached(cfg):
            sc.rollout.engines.urls = [eng.urls[j] for j in block]
        else:
            sc.rollout.engines.count, sc.rollout.engines.base_port = len(block), eng.base_port + block.start
        out.append((f"rollout{i}", sc.rollout.url, save_config(sc, Path(cfg.run.out) / f"rollout{i}.yaml")))
    cfg.rollout.url, cfg.rollout.extra_urls = out[0][1], [url for _, url, _ in out[1:]]
    return out


def _assign_engines(bundles: list[Bundle], count: int, engine_tp: int, services: int) -> list[dict[str, Any]]:
    owner = {e: i for i, block in enumerate(engine_blocks(count, services, "run.num_gpus.rollout / "
                                                           "rollout.engines.tp")) for e in block}
    engines = []
    for e in range(count):
        members = bundles[e * engine_tp:(e + 1) * engine_tp]
        if len({b.node for b in members}) != 1:
            raise PlanError(f"engine {e} would span nodes {sorted({b.node for b in members})}: "
                            f"rollout.engines.tp ({engine_tp}) must fit within one node's GPUs")
        for r, b in enumerate(members):
            b.processes.append(f"engine:{e}:tp{r}")
        engines.append({"engine": e, "bundles": [b.index for b in members], "node": members[0].node,
                        "rollout": owner[e]})
    return engines


def make_plan(config: HeadraceConfig, placement: Placement, nodes: list[Node]) -> Plan:
    """Place trainer ranks and engine TP ranks on GPU bundles; raise PlanError when infeasible."""
    if placement not in ("colocated", "disaggregated"):
        raise PlanError(f"--placement must be colocated or disaggregated, not {placement!r}")
    t, r = config.run.num_gpus.trainer, config.run.num_gpus.rollout
    tp, dp, etp = config.trainer.tp, config.trainer.dp, config.rollout.engines.tp
    if t < 1 or r < 1:
        raise PlanError(f"run.num_gpus.trainer ({t}) and run.num_gpus.rollout ({r}) must both be >= 1 for a GPU launch")
    if tp * dp != t:
        raise PlanError(f"trainer.tp x trainer.dp ({tp} x {dp} = {tp * dp}) must equal run.num_gpus.trainer ({t})")
    if r % etp:
        raise PlanError(f"rollout.engines.tp ({etp}) must divide run.num_gpus.rollout ({r})")
    need = max(t, r) if placement == "colocated" else t + r
    if placement == "colocated" and r > t:
        raise PlanError(f"colocated: run.num_gpus.rollout ({r}) cannot exceed run.num_gpus.trainer ({t}); "
                        "engines share the trainer's GPUs")
    slots = _slots(nodes)
    if need > len(slots):
        have = ", ".join(f"{n.name}: {n.gpus}" for n in nodes) or "none"
        raise PlanError(f"{placement} needs {need} GPUs (trainer {t}, rollout {r}) but the cluster has {len(slots)} ({have})")
    bundles = [Bundle(index=i, node=node, gpu=gpu) for i, (node, gpu) in enumerate(slots[:need])]
    for rank in range(t):
        bundles[rank].processes.append(f"trainer:{rank}")
    rollout_bundles = bundles[:r] if placement == "colocated" else bundles[t:t + r]
    k = config.run.rollout_services
    engines = _assign_engines(rollout_bundles, r // etp, etp, k)
    services = ["buffer", "rollout"] if k == 1 else ["buffer", *(f"rollout:{i}" for i in range(k))]
    return Plan(placement=placement, bundles=bundles, trainer={"tp": tp, "dp": dp, "world_size": t}, engines=engines,
                services=services)


def assumed_nodes(gpus: int) -> list[Node]:
    """One imaginary node with ``gpus`` GPUs (``--assume-gpus``; no Ray needed)."""
    return [Node(name="node-0", gpus=gpus)]


def ray_nodes() -> list[Node]:
    """Alive GPU nodes of the connected Ray cluster (imports ray; call ray.init first)."""
    import ray

    nodes = []
    for n in ray.nodes():
        if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1:
            nodes.append(Node(name=n.get("NodeManagerAddress", n["NodeID"]), gpus=int(n["Resources"]["GPU"])))
    return nodes
