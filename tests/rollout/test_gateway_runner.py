"""The in-service agent runner and episode store in-process, for agents that never reach the model:
an agent that raises, one that returns a non-number, and one that hangs past the idle timeout all
yield failed samples (reason in metadata) instead of stopping anything; the plugin loader refuses a
non-async agent. (Agents that do call the model: test_gateway_agents.py, with real services.)"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from headrace.rollout.data import PromptItem
from headrace.rollout.gateway.agents import AgentRunner, load_agent
from headrace.rollout.gateway.episodes import EpisodeContext, EpisodeStore
from headrace.rollout.rewards import exact_match
from headrace.shared.config import RolloutConfig
from headrace.shared.modelzoo import load_tokenizer


async def raises(ctx: Any, task: dict) -> float:
    raise RuntimeError("tool crashed")


async def not_a_number(ctx: Any, task: dict) -> Any:
    return "great"


async def hangs(ctx: Any, task: dict) -> float:
    await asyncio.sleep(3600)
    return 1.0


def _runner(tiny_model: Path, fn: Any, timeout_s: float = 600.0) -> tuple[AgentRunner, EpisodeStore]:
    tok = load_tokenizer(tiny_model)
    rc = RolloutConfig()
    store = EpisodeStore(tok, exact_match, lambda: EpisodeContext(None, tok, rc, logging.getLogger("t")),
                         push=None, run_id="r", timeout_s=timeout_s, reward_timeout_s=5.0, version=lambda: 3)
    return AgentRunner(fn, store, "http://127.0.0.1:9", rc, n=2), store


@pytest.mark.parametrize("fn,why", [(raises, "agent: RuntimeError: tool crashed"),
                                    (not_a_number, "agent must return a finite float or None")])
def test_failing_agents_fail_their_samples(tiny_model: Path, fn: Any, why: str) -> None:
    runner, store = _runner(tiny_model, fn)
    item = PromptItem(position=0, epoch=0, prompt="What is 1 + 1?", label="2")

    async def run() -> list:
        try:
            return await runner(item, "g")
        finally:
            await runner.close()

    samples = asyncio.run(run())
    assert len(samples) == 2 and all(s.status == "failed" and s.reward is None for s in samples)
    assert all(why in s.metadata["error"] for s in samples)
    assert store.episodes == {} and store.counts["episodes_failed"] == 2


def test_hanging_agent_times_out(tiny_model: Path) -> None:
    runner, store = _runner(tiny_model, hangs, timeout_s=0.5)
    item = PromptItem(position=0, epoch=0, prompt="What is 1 + 1?", label="2")

    async def run() -> list:
        store.start()
        try:
            return await asyncio.wait_for(runner(item, "g"), 60)
        finally:
            await store.stop()
            await runner.close()

    samples = asyncio.run(run())
    assert all(s.status == "failed" and "idle" in s.metadata["error"] for s in samples)
    assert store.counts["episodes_timed_out"] == 2


def test_agent_must_be_async(tmp_path: Path) -> None:
    f = tmp_path / "sync_agent.py"
    f.write_text("def agent(ctx, task):\n    return 1.0\n")
    with pytest.raises(ValueError, match="must be an async function"):
        load_agent(f"{f}:agent")
