"""Placement plans: which GPU bundle holds which trainer rank and engine TP rank.

A plan is pure data computed from the run config and a list of nodes (GPUs per node); it starts
nothing, so ``headrace launch --dry-run`` and the Ray launcher share it. Guarantees:

- bundles are ordered by node, then GPU id; every bundle is one GPU;
- colocated: trainer ranks and engines share the same bundles (engine e, TP rank r lives on bundle
  ``e * rollout.engines.tp + r``); disaggregated: trainer bundles come first, rollout bundles after them;
- an engine's TP ranks never span two nodes, trainer world = ``tp x dp`` = ``run.num_gpus.trainer``;
- anything infeasible raises ``PlanError`` naming the config keys involved, before anything starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from headrace.shared.config import HeadraceConfig

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


def _assign_engines(bundles: list[Bundle], count: int, engine_tp: int) -> list[dict[str, Any]]:
    engines = []
    for e in range(count):
        members = bundles[e * engine_tp:(e + 1) * engine_tp]
        if len({b.node for b in members}) != 1:
            raise PlanError(f"engine {e} would span nodes {sorted({b.node for b in members})}: "
                            f"rollout.engines.tp ({engine_tp}) must fit within one node's GPUs")
        for r, b in enumerate(members):
            b.processes.append(f"engine:{e}:tp{r}")
        engines.append({"engine": e, "bundles": [b.index for b in members], "node": members[0].node})
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
    engines = _assign_engines(rollout_bundles, r // etp, etp)
    return Plan(placement=placement, bundles=bundles, trainer={"tp": tp, "dp": dp, "world_size": t}, engines=engines)


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
