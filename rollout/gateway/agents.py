"""In-service agents: ``rollout.agent`` run ``n_samples_per_prompt`` times per prompt as one group.

Contract (DESIGN.md)::

    async def agent(ctx: AgentContext, task: dict) -> float | None   # reward, or None for the reward fn

``ctx.client`` is an ``openai.AsyncOpenAI`` bound to a fresh episode (``ctx.base_url`` and
``ctx.api_key`` for code that builds its own client); ``task`` is ``{"prompt": str | None,
"messages": list | None, "label": any, "metadata": {}}`` after ``input_key`` and ``prompt_template``.

Guarantees:
- Each run is an episode of the gateway (token-exact recording, one engine per episode, calls wait
  during a pause or weight sync, partial rollouts resumed); its samples go to the rollout loop,
  which filters and pushes the group like a generator's (same group ids, same data-slot bookkeeping).
- An agent that raises, returns something other than a number or None, or leaves its episode idle
  past ``rollout.gateway.episode_timeout_s`` yields failed samples (reason in metadata["error"]);
  the loop keeps running.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from headrace.rollout.gateway.episodes import group_samples
from headrace.rollout.gateway.inproc import AppTransport, http_library, shared_client_class
from headrace.rollout.gateway.sdk_params import install as install_plain_params
from headrace.shared.plugins import load_plugin
from headrace.shared.schemas import Sample

if TYPE_CHECKING:
    from headrace.rollout.data import PromptItem
    from headrace.rollout.gateway.episodes import EpisodeStore

AgentFn = Callable[["AgentContext", dict[str, Any]], Awaitable["float | None"]]
log = logging.getLogger("headrace.rollout.agent")


@dataclass
class AgentContext:
    """What an agent gets: an OpenAI client bound to its episode, and where that client points."""

    client: Any
    base_url: str
    api_key: str
    episode_id: str
    config: Any
    logger: logging.Logger


def load_agent(spec: str) -> AgentFn:
    """The ``rollout.agent`` plugin; ValueError unless it is an async function of (ctx, task)."""
    fn = load_plugin(spec, what="rollout.agent")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.agent {spec!r}: must be an async function "
                         "(async def agent(ctx, task) -> float | None)")
    return fn


class AgentRunner:
    """Runs the agent for one prompt slot: n episodes at once, their samples as one list."""

    def __init__(self, fn: AgentFn, store: "EpisodeStore", base_url: str, config: Any, n: int,
                 app: Any = None, direct: Callable[[], dict[str, Any]] | None = None,
                 max_body: int | None = None) -> None:
        """``app``: the service's app behind its body limit (``max_body`` bytes); ``direct``: its
        routes served without the ASGI layers (``inproc.AppTransport``)."""
        self.fn = fn
        self.direct = direct
        self.max_body = max_body
        self.store = store
        self.origin = base_url.rstrip("/")
        self.base_url = self.origin + "/openai/v1"
        self.config = config
        self.n = n
        self.app = app
        self._ssl: Any = None
        self._shared: Any = None
        self._template: Any = None
        self._platform: Any = None   # what the SDK's get_platform() answered (see ``_client``)
        install_plain_params()   # the SDK's params walk costs ~0.26 ms a call in this loop (sdk_params)

    def _client(self, key: str) -> tuple[Any, Any]:
        """An OpenAI client for one episode (closed with the episode). With the service's ASGI app
        (``app``), its requests are served in-process (``inproc.AppTransport``: no socket, same app);
        without, over loopback on its own connection pool: httpcore scans every pooled connection on
        each request, so one pool shared by all episodes costs O(episodes) per call."""
        import httpx
        import openai

        if self.app is not None:   # no connections to hold: one HTTP client serves every episode
            if self._shared is None:
                http = http_library()
                transport = AppTransport(self.app, self.origin, http, self.direct, self.max_body)
                self._shared = shared_client_class(http)(transport=transport, trust_env=False,
                                                         timeout=http.Timeout(None, connect=60.0))
                # every episode's client is this one's copy with the episode's key (the SDK's own
                # ``with_options``: a quarter of the CPU of constructing one from scratch)
                self._template = openai.AsyncOpenAI(base_url=self.base_url, api_key="hr-ep-unused",
                                                    http_client=self._shared, max_retries=0)
            client = self._template.with_options(api_key=key)
            self._share_platform(client)
            return client, None
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()   # built once: loading CA certificates costs ms
        # keep-alive expiry below uvicorn's 5 s: a connection the server is closing is never reused
        # (that race surfaced as APIConnectionError in ~1% of episodes under load)
        http = httpx.AsyncClient(verify=self._ssl, timeout=httpx.Timeout(None, connect=60.0),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=8,
                                                     keepalive_expiry=1.0))
        # no SDK retries: a retried call after a lost answer would be a second call of the episode
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=key, http_client=http, max_retries=0)
        self._share_platform(client)
        return client, http

    def _share_platform(self, client: Any) -> None:
        """Give a fresh client the platform its SDK computed once for this process. A new
        ``AsyncOpenAI`` runs ``get_platform()`` in a worker thread on its first request (a thread
        hop per episode: ~1 ms of the service's CPU for a one-call episode); the value is a property
        of the process (the ``X-Stainless-OS`` header), so it is computed once, by the SDK's own
        function, and every later client starts with it. An SDK without the attribute is left alone."""
        if not hasattr(client, "_platform"):
            return
        if self._platform is None:
            from openai._base_client import get_platform

            self._platform = get_platform()
        client._platform = self._platform

    async def __call__(self, item: "PromptItem", gid: str) -> list[Sample]:
        p = item.prompt
        task = {"prompt": p if isinstance(p, str) else None, "messages": p if isinstance(p, list) else None,
                "label": item.label, "metadata": dict(item.metadata)}
        runs = await asyncio.gather(*(self._one(gid, task, item) for _ in range(self.n)))
        return group_samples(gid, [s for samples in runs for s in samples])

    async def _one(self, gid: str, task: dict[str, Any], item: "PromptItem") -> list[Sample]:
        ep, key = self.store.open(group_id=gid, label=item.label, metadata=dict(item.metadata), managed=False)
        client, http = self._client(key)
        ctx = AgentContext(client, self.base_url, key, ep.id, self.config,
                           logging.getLogger("headrace.rollout.plugin"))
        run = asyncio.ensure_future(self.fn(ctx, dict(task, metadata=dict(task["metadata"]))))
        ended = asyncio.ensure_future(ep.done.wait())
        await asyncio.wait({run, ended}, return_when=asyncio.FIRST_COMPLETED)
        reward, error = None, None
        if not run.done():          # the episode timed out while the agent still ran
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        elif run.exception() is not None:
            e = run.exception()
            log.warning("agent failed in episode %s: %s: %s", ep.id, type(e).__name__, e)
            error = f"agent: {type(e).__name__}: {e}"
        else:
            out = run.result()
            if out is not None and (isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out)):
                error = f"agent must return a finite float or None, got {type(out).__name__} {str(out)[:40]}"
            reward = None if out is None or error else float(out)
        ended.cancel()
        if http is not None:
            await http.aclose()
        await self.store.finish(ep, reward=reward, error=error)
        return ep.samples

    async def close(self) -> None:
        """Close the in-process HTTP client (a loopback episode's client is closed with its episode)."""
        if self._shared is not None:
            await self._shared.close_shared()
            self._shared = self._template = None
