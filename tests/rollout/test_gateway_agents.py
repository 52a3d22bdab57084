"""In-service agents (``rollout.agent``): the example ReAct calculator agent (plain OpenAI SDK) run by
the rollout service into a buffer, in continuous and on_demand mode; nothing is trained. Two stacks
(~25 s each on the 2-core machine)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.procs import REPO
from tests.rollout.gateway_support import TokenStack, write_tasks

AGENT = str(REPO / "examples" / "agents" / "react_calculator.py") + ":agent"


def _stack(tmp: Path, model: Path, mode: str) -> TokenStack:
    return TokenStack(tmp, model, {
        "mode": mode, "agent": AGENT, "data": {"path": str(write_tasks(tmp.parent / f"{mode}.jsonl", 6))},
        "n_samples_per_prompt": 2, "groups_per_step": 2, "sampling": {"max_new_tokens": 6}})


def _check(groups: list, n: int) -> None:
    assert len(groups) >= n
    for g in groups:
        assert len(g.samples) >= 2 and [s.index for s in g.samples] == list(range(len(g.samples)))
        prompts = {tuple(s.tokens[: s.prompt_length]) for s in g.samples}
        assert len(prompts) == 1, "the samples of a group share their prompt"
        for s in g.samples:
            assert s.status != "failed", s.metadata
            assert s.reward in (0.0, 1.0) and 1 in s.loss_mask and s.metadata["episode_id"].startswith("ep-")
            assert len(s.rollout_logprobs) == s.response_length


@pytest.mark.slow
def test_agent_continuous(tiny_model: Path, tmp_path: Path) -> None:
    st = _stack(tmp_path / "c", tiny_model, "continuous").start()
    try:
        deadline = time.monotonic() + 180
        while st.buffer_stats()["queued"] < 2 and time.monotonic() < deadline:
            assert st.rollout.alive(), st.rollout.log()[-3000:]
            time.sleep(0.5)
        _check(st.buffer_groups(), 2)
        gw = st.status()["gateway"]
        assert gw["calls"] >= 4 and gw["episodes_finished"] >= 4 and gw["episodes_held"] <= gw["episodes_opened"]
    finally:
        st.stop()


@pytest.mark.slow
def test_agent_on_demand(tiny_model: Path, tmp_path: Path) -> None:
    st = _stack(tmp_path / "d", tiny_model, "on_demand").start()
    try:
        r = st.call("POST", "/v1/generate_batch", {"groups": 2})
        assert r.status_code == 200 and r.json()["groups"] == 2, r.text
        _check(st.buffer_groups(), 2)
    finally:
        st.stop()
