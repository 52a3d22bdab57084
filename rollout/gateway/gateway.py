"""The agent gateway as one object the rollout service owns: episode store, OpenAI calls, agent runner.

Guarantees: built at service start (it needs the engine client and the loop's pusher); ``stop``
cancels the idle-timeout sweeper and closes the agents' HTTP client. Episodes live in memory: a
restart of the rollout service loses open episodes (their agents get 401 and open new ones).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from headrace.rollout.gateway.agents import AgentFn, AgentRunner
from headrace.rollout.gateway.calls import Calls
from headrace.rollout.gateway.episodes import EpisodeContext, EpisodeStore
from headrace.rollout.gateway.inproc import direct_routes
from headrace.rollout.generate import EngineClient
from headrace.rollout.rewards import RewardFn
from headrace.shared.config import HeadraceConfig
from headrace.shared.serving import BodyLimit

log = logging.getLogger("headrace.rollout.gateway")


def local_url(host: str, port: int) -> str:
    """How this process reaches its own HTTP port (a wildcard bind is reached on loopback)."""
    h = "127.0.0.1" if host in ("0.0.0.0", "::", "", "localhost") else host
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


class Gateway:
    def __init__(self, cfg: HeadraceConfig, engine: EngineClient, tokenizer: Any, reward_fn: RewardFn,
                 push: Any, run_id: str, http: Any, agent_fn: AgentFn | None = None, app: Any = None) -> None:
        """``app``: the service's ASGI app; in-service agents' calls are then served in-process
        through it, behind the same body limit as the socket (``inproc.AppTransport``)."""
        rc = cfg.rollout
        self.model_name = rc.gateway.model_name or Path(cfg.model).name
        plugin_log = logging.getLogger("headrace.rollout.plugin")

        def ctx() -> EpisodeContext:
            return EpisodeContext(engine, tokenizer, rc, plugin_log, http)

        self.store = EpisodeStore(tokenizer, reward_fn, ctx, push, run_id, rc.gateway.episode_timeout_s,
                                  rc.reward_timeout_s, lambda: engine.gate.version)
        self.calls = Calls(rc, engine, tokenizer, self.store, self.model_name)
        max_body = int(rc.max_body_mb * 1024 * 1024)
        limited = BodyLimit(app, max_body, "rollout.max_body_mb") if app else None
        self.agent = AgentRunner(agent_fn, self.store, local_url(rc.host, rc.port), rc, rc.n_samples_per_prompt,
                                 limited, lambda: direct_routes(app), max_body) if agent_fn else None

    def start(self) -> None:
        self.store.start()

    async def stop(self) -> None:
        await self.store.stop()
        if self.agent is not None:
            await self.agent.close()

    def status(self) -> dict[str, Any]:
        return {"model": self.model_name, **self.store.status()}
