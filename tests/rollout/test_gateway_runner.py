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


def test_finish_checks_each_segment_against_the_row_schema(tiny_model: Path) -> None:
    """A recorded segment becomes a valid sample with its reward; one whose values break the row
    schema (a logprob above 0 here, a label that is not JSON) becomes a failed sample naming the
    field, and the episode's other segment is kept."""
    from headrace.rollout.gateway.recording import Segment

    _, store = _runner(tiny_model, raises)

    def segment(logprob: float) -> Segment:
        seg = Segment(tokens=[5, 6, 7], prompt_length=3)
        seg.add_completion([8, 9], [-0.5, logprob], version=2, finish="stop")
        seg.add_context([10])
        return seg

    async def finish(label: Any, logprobs: tuple[float, float]) -> list:
        ep, _ = store.open(label=label, managed=False)
        ep.segments = [segment(logprobs[0]), segment(logprobs[1])]
        ep.segments[1].logprobs[-2] = logprobs[1]   # past add_completion's clamp: as if recorded wrong
        return (await store.finish(ep, reward=1.0)).samples

    good = asyncio.run(finish("2", (-0.1, -0.2)))
    assert [s.status for s in good] == ["completed", "completed"] and [s.reward for s in good] == [1.0, 1.0]
    assert good[0].loss_mask == [1, 1, 0] and good[0].rollout_logprobs == [-0.5, -0.1, 0.0]
    assert good[1].metadata["segment"] == 1 and good[0].weight_version == 2
    bad = asyncio.run(finish("2", (-0.1, 0.5)))
    assert bad[0].status == "completed" and bad[1].status == "failed"
    assert "invalid sample" in bad[1].metadata["error"] and "rollout_logprobs" in bad[1].metadata["error"]
    not_json = asyncio.run(finish({1, 2}, (-0.1, -0.2)))
    assert all(s.status == "failed" and "label" in s.metadata["error"] for s in not_json), not_json[0].metadata
