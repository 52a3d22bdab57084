"""Built-in rewards and the reward-calling contract (errors fail the sample, never the loop)."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from pathlib import Path

import httpx
import pytest
import reasoning_gym

from headrace.rollout.generate import RolloutContext
from headrace.rollout.rewards import BUILTIN_REWARDS, load_reward, score_sample
from headrace.rollout.prompts import prompt_sample
from headrace.shared.config import RolloutConfig
from headrace.shared.plugins import PluginError
from tests.procs import Proc, child_env, free_port

LOG = logging.getLogger("test")


def _sample(response: str, label: object = None, **kw: object):
    return prompt_sample(uid="u-0", group_id="u", tokens=[1, 2, 3], response=response, label=label, **kw)


def _score(fn, sample, config: RolloutConfig | None = None, http: httpx.AsyncClient | None = None):
    ctx = RolloutContext(None, None, config or RolloutConfig(), LOG, http)
    return asyncio.run(score_sample(fn, ctx, sample, 10.0))


def test_exact_match() -> None:
    f = BUILTIN_REWARDS["exact_match"]
    assert _score(f, _sample(" 42 \n", "42")).reward == 1.0
    assert _score(f, _sample("thinking\n42", "42")).reward == 1.0
    assert _score(f, _sample("420", "42")).reward == 0.0


def test_math_equivalence() -> None:
    f = BUILTIN_REWARDS["math"]
    assert _score(f, _sample("so the answer is \\boxed{0.5}", "1/2")).reward == 1.0
    assert _score(f, _sample("\\boxed{\\frac{2}{4}}", "\\boxed{0.5}")).reward == 1.0
    assert _score(f, _sample("\\boxed{3}", "4")).reward == 0.0


def test_reasoning_gym_verifier_and_binary() -> None:
    ds = reasoning_gym.create_dataset("chain_sum", seed=1, size=2, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    e = ds[0]
    label = {"task": "chain_sum", "answer": e["answer"], "metadata": e["metadata"]}
    right = _score(BUILTIN_REWARDS["reasoning_gym"], _sample(e["answer"], label))
    tagged = _score(BUILTIN_REWARDS["reasoning_gym"], _sample(f"hmm <answer>{e['answer']}</answer>", label))
    wrong = _score(BUILTIN_REWARDS["reasoning_gym_binary"], _sample(str(int(e["answer"]) + 1), label))
    assert right.reward == 1.0 and tagged.reward == 1.0 and wrong.reward == 0.0


def test_reward_faults_fail_the_sample() -> None:
    def raises(ctx, s):
        raise RuntimeError("boom")

    async def wrong_type(ctx, s):
        return "1.0"

    def nan(ctx, s):
        return math.nan

    def no_key(ctx, s):
        return {"score": 1.0}

    for fn, needle in ((raises, "boom"), (wrong_type, "str"), (nan, "non-finite"), (no_key, "without 'reward'")):
        s = _score(fn, _sample("x", "y"))
        assert s.status == "failed" and s.reward is None and needle in s.metadata["error"]
    missing_label = _score(BUILTIN_REWARDS["exact_match"], _sample("x"))
    assert missing_label.status == "failed" and "label" in missing_label.metadata["error"]


def test_dict_reward_extras_go_to_metadata() -> None:
    s = _score(lambda ctx, s: {"reward": 0.5, "format": 1.0}, _sample("x", "y"))
    assert s.reward == 0.5 and s.metadata["rewards"] == {"format": 1.0}


def test_load_reward_errors() -> None:
    assert load_reward("math") is BUILTIN_REWARDS["math"]
    with pytest.raises(ValueError, match="not a built-in"):
        load_reward("nope")
    with pytest.raises(PluginError, match="not found"):
        load_reward("no_such_module_xyz:reward")


REWARD_SERVER = """
import sys, uvicorn
from fastapi import FastAPI, Request
app = FastAPI()
@app.post("/score")
async def score(req: Request):
    b = await req.json()
    if b["response"] == "crash":
        return {"oops": 1}
    return {"reward": float(b["response"] == b["label"]), "judge": 0.25}
@app.get("/health")
async def health():
    return {}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_remote_reward_over_http(tmp_path: Path) -> None:
    script = tmp_path / "reward_server.py"
    script.write_text(REWARD_SERVER)
    port = free_port()
    proc = Proc([sys.executable, str(script), str(port)], tmp_path / "reward.log", env=child_env())
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        cfg = RolloutConfig(reward="remote", reward_url=f"http://127.0.0.1:{port}/score")

        async def run():
            async with httpx.AsyncClient() as http:
                ctx = RolloutContext(None, None, cfg, LOG, http)
                f = load_reward("remote")
                return [await score_sample(f, ctx, _sample(r, "7"), 10.0) for r in ("7", "8", "crash")]

        good, bad, crash = asyncio.run(run())
        assert (good.reward, good.metadata["rewards"], bad.reward) == (1.0, {"judge": 0.25}, 0.0)
        assert crash.status == "failed" and "reward" in crash.metadata["error"]
    finally:
        proc.stop()
