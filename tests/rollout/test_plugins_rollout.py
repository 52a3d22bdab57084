"""Rollout plugin contracts through the real loader: generator, reward, filter, and their errors."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from pathlib import Path

import pytest

from headrace.rollout.filters import apply_filter, load_filter, zero_variance
from headrace.rollout.generate import RolloutContext
from headrace.rollout.generate import check_generator
from headrace.rollout.prompts import prompt_sample
from headrace.rollout.rewards import load_reward, score_sample
from headrace.shared.config import RolloutConfig
from headrace.shared.plugins import PluginError, load_plugin
from headrace.shared.schemas import Group, Sample
from tests.procs import REPO, child_env, headrace_cmd

LOG = logging.getLogger("test")


def _group(rewards: list[float | None]) -> Group:
    samples = [Sample(uid=f"g-{i}", group_id="g", index=i, tokens=[1], reward=r,
                      status="completed" if r is not None else "failed") for i, r in enumerate(rewards)]
    return Group(group_id="g", samples=samples)


def _ctx() -> RolloutContext:
    return RolloutContext(None, None, RolloutConfig(), LOG)


def test_generator_from_a_file_outside_the_package(tmp_path: Path) -> None:
    (tmp_path / "my_gen.py").write_text(
        "async def generate(ctx, sample, sampling):\n    return sample\n"
        "def not_async(ctx, sample, sampling):\n    return sample\n")
    fn = load_plugin(f"{tmp_path}/my_gen.py:generate", what="rollout.generate")
    check_generator(fn, "my_gen.py:generate")
    with pytest.raises(ValueError, match="must be an async function"):
        check_generator(load_plugin(f"{tmp_path}/my_gen.py:not_async"), "my_gen.py:not_async")
    with pytest.raises(PluginError, match="does not exist"):
        load_plugin(f"{tmp_path}/missing.py:generate")
    with pytest.raises(PluginError, match="no attribute"):
        load_plugin(f"{tmp_path}/my_gen.py:nope")


def test_builtin_zero_variance_filter() -> None:
    assert zero_variance(_ctx(), _group([0.0, 1.0, 0.0]))
    assert not zero_variance(_ctx(), _group([1.0, 1.0, 1.0]))
    assert not zero_variance(_ctx(), _group([1.0, None]))  # one scored sample carries no signal
    assert load_filter("zero_variance") is zero_variance and load_filter(None) is None


def test_filter_faults_keep_the_group(tmp_path: Path) -> None:
    (tmp_path / "filters.py").write_text(
        "def raises(ctx, g):\n    raise KeyError('x')\n"
        "def wrong(ctx, g):\n    return 'yes'\n"
        "def drop(ctx, g):\n    return False\n"
        "async def asynchronous(ctx, g):\n    return True\n")
    g = _group([0.0, 1.0])
    assert apply_filter(load_filter(f"{tmp_path}/filters.py:raises"), _ctx(), g) == (True, "filter raised KeyError: 'x'")
    keep, err = apply_filter(load_filter(f"{tmp_path}/filters.py:wrong"), _ctx(), g)
    assert keep and "expected bool" in err
    assert apply_filter(load_filter(f"{tmp_path}/filters.py:drop"), _ctx(), g) == (False, None)
    with pytest.raises(ValueError, match="not async"):
        load_filter(f"{tmp_path}/filters.py:asynchronous")
    with pytest.raises(ValueError, match="not a built-in"):
        load_filter("variance")


def test_example_reward_and_calculator_through_the_loader() -> None:
    reward = load_reward(f"{REPO}/examples/custom_reward.py:reward")
    s = prompt_sample(uid="u-0", group_id="u", tokens=[1, 2, 3, 4], response="it is 56", label="56")
    s.response_length, s.loss_mask = 1, [1]
    out = asyncio.run(score_sample(reward, _ctx(), s, 5.0))
    assert out.reward == pytest.approx(1.0 - 0.001) and out.metadata["rewards"]["correct"] == 1.0
    calc = load_plugin(f"{REPO}/examples/calculator_generator.py:calculate")
    call = load_plugin(f"{REPO}/examples/calculator_generator.py:tool_call")
    assert calc("12*(3+4)") == "84" and calc("7/2") == "3.5"
    assert calc("__import__('os')").startswith("error") and calc("1/0").startswith("error")
    assert call("let me see <calc>2+3</calc>") == "2+3" and call("<calc> 9*9") == " 9*9" and call("no") is None


@pytest.mark.parametrize("rollout_yaml, needle", [
    ("generate: /nonexistent/gen.py:generate", "does not exist"),
    ("generate: json:dumps", "must be an async function"),
    ("reward: no_such_module_abc:reward", "not found"),
    ("filter: not_a_filter", "not a built-in"),
    ("n_samples_per_prompt: 0", "rollout.n_samples_per_prompt"),
    ("bogus_key: 1", "rollout.bogus_key: unknown key"),
])
def test_bad_config_stops_serve_with_a_clear_message(tmp_path: Path, rollout_yaml: str, needle: str) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {tmp_path}/no-model\nrollout:\n  data: {{path: {tmp_path}/p.jsonl}}\n  {rollout_yaml}\n"
                   f"run: {{out: {tmp_path}/run}}\n")
    r = subprocess.run(headrace_cmd("rollout", "serve", "--config", str(cfg), "--port", "0"), cwd=REPO,
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
