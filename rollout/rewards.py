"""Reward functions: built-ins and the one place user reward plugins are resolved and called.

Contract (DESIGN.md): ``async def reward(ctx, sample) -> float | dict[str, float]`` (a plain
``def`` is accepted too). A dict must hold ``"reward"``; its other entries land in
``sample.metadata["rewards"]``.

Built-ins, by name in ``rollout.reward``:
- ``exact_match``: 1.0 when the stripped response equals ``str(label)`` (or its last line does).
- ``math``: 1.0 when math-verify finds the response's final/boxed answer equivalent to the label.
- ``reasoning_gym``: the task's own ``score_answer`` (partial credit possible); the label is the
  ``{"task", "answer", "metadata"}`` dict built by the reasoning-gym data source.
- ``reasoning_gym_binary``: 1.0 only when ``score_answer`` gives 1.0 (the demo's reward).
- ``remote``: POST ``{"prompt","response","label","metadata"}`` to ``rollout.reward_url``; the
  answer is a number or ``{"reward": x, ...}``.

``score_sample`` never raises: an exception, a wrong type or a non-finite value marks the sample
``failed`` with reward null and the reason in ``metadata["error"]``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import httpx

from headrace.shared.plugins import load_plugin
from headrace.shared.schemas import FAILED, Sample, SampleStatus

if TYPE_CHECKING:
    from headrace.rollout.generate import RolloutContext

RewardFn = Callable[["RolloutContext", Sample], "Awaitable[float | dict[str, float]] | float | dict[str, float]"]


def _text(sample: Sample) -> str:
    return sample.response or ""


def exact_match(ctx: "RolloutContext", sample: Sample) -> float:
    """1.0 when the response (or its last non-empty line) equals the label, whitespace stripped."""
    if sample.label is None:
        raise ValueError("exact_match needs a label (data.label_key)")
    want = str(sample.label).strip()
    got = _text(sample).strip()
    lines = [ln.strip() for ln in got.splitlines() if ln.strip()]
    return 1.0 if got == want or (lines and lines[-1] == want) else 0.0


def math_reward(ctx: "RolloutContext", sample: Sample) -> float:
    """1.0 when math-verify judges the final answer equal to the label (boxed, fraction, ...)."""
    from math_verify import parse, verify

    if sample.label is None:
        raise ValueError("math reward needs a label (data.label_key)")
    gold = parse(str(sample.label) if "\\boxed" in str(sample.label) or "$" in str(sample.label)
                 else f"${sample.label}$")
    pred = parse(_text(sample))
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


@lru_cache(maxsize=256)
def _rg_scorer(task: str) -> Callable[[str, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def reasoning_gym_reward(ctx: "RolloutContext", sample: Sample) -> float:
    """The reasoning-gym task's own verifier on the response (an ``<answer>`` tag is honoured)."""
    label = sample.label
    if not isinstance(label, dict) or "task" not in label or "answer" not in label:
        raise ValueError("reasoning_gym reward needs a label {'task','answer','metadata'} (data.task source)")
    text = _text(sample)
    m = _ANSWER_TAG.findall(text)
    answer = (m[-1] if m else text).strip()
    entry = {"question": sample.prompt or "", "answer": label["answer"], "metadata": label.get("metadata", {})}
    return float(_rg_scorer(label["task"])(answer, entry))


def reasoning_gym_binary(ctx: "RolloutContext", sample: Sample) -> float:
    """1.0 only for a fully correct answer (reasoning-gym gives partial credit otherwise)."""
    return 1.0 if reasoning_gym_reward(ctx, sample) >= 1.0 else 0.0


async def remote_reward(ctx: "RolloutContext", sample: Sample) -> float | dict[str, float]:
    """POST the sample to ``rollout.reward_url``; a number or {"reward": x, ...} comes back."""
    url = ctx.config.reward_url
    if not url:
        raise ValueError("reward: remote needs rollout.reward_url")
    client: httpx.AsyncClient = ctx.http
    r = await client.post(url, json={"prompt": sample.prompt, "response": sample.response,
                                     "label": sample.label, "metadata": sample.metadata},
                          timeout=ctx.config.reward_timeout_s)
    r.raise_for_status()
    return r.json()


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_reward,
    "reasoning_gym": reasoning_gym_reward,
    "reasoning_gym_binary": reasoning_gym_binary,
    "remote": remote_reward,
}


def load_reward(spec: str) -> RewardFn:
    """A built-in reward by name, or a ``module:function`` / ``file.py:function`` plugin."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"rollout.reward {spec!r}: not a built-in ({', '.join(BUILTIN_REWARDS)}) "
                         "and not a module:function path")
    return load_plugin(spec, what="reward")


async def score_sample(fn: RewardFn, ctx: "RolloutContext", sample: Sample, timeout_s: float) -> Sample:
    """Set ``sample.reward`` (or mark it failed); never raises for a plugin's fault."""
    pending = score_now(fn, ctx, sample)
    if pending is not None:
        await score_later(pending, ctx, sample, timeout_s)
    return sample


def score_now(fn: RewardFn, ctx: "RolloutContext", sample: Sample) -> Awaitable[Any] | None:
    """``score_sample`` without a task when it can: a reward function that answers at once (a plain
    ``def``, as the built-ins but ``remote``) is applied here and None is returned; an awaitable
    answer is returned as it is, for ``score_later`` to finish with the same outcome."""
    if sample.status == FAILED:
        sample.reward = None
        return None
    try:
        out = fn(ctx, sample)
    except Exception as e:  # noqa: BLE001 - a reward fault fails the sample, never the loop
        _reward_failed(ctx, sample, e)
        return None
    if type(out) is float and -math.inf < out < math.inf:   # the usual answer: what _apply_reward makes of it
        sample.reward = out
        return None
    if inspect.isawaitable(out):
        return out
    _apply_reward(out, ctx, sample)
    return None


async def score_later(out: Awaitable[Any], ctx: "RolloutContext", sample: Sample, timeout_s: float) -> None:
    """Await what ``score_now`` returned (at most ``timeout_s``) and apply it, as ``score_sample``."""
    try:
        value = await asyncio.wait_for(out, timeout_s)
    except Exception as e:  # noqa: BLE001 - a reward fault fails the sample, never the loop
        _reward_failed(ctx, sample, e)
        return
    _apply_reward(value, ctx, sample)


def drop(pending: Awaitable[Any]) -> None:
    """Discard an awaitable ``score_now`` returned that will not be awaited (no warning, no task)."""
    if inspect.iscoroutine(pending):
        pending.close()
    elif asyncio.isfuture(pending):
        pending.cancel()


def _apply_reward(out: Any, ctx: "RolloutContext", sample: Sample) -> None:
    try:
        extra: dict[str, float] = {}
        if isinstance(out, dict):
            if "reward" not in out:
                raise TypeError(f"reward returned a dict without 'reward' (keys {sorted(out)})")
            extra = {k: float(v) for k, v in out.items() if k != "reward"}
            out = out["reward"]
        if isinstance(out, bool) or not isinstance(out, (int, float)):
            raise TypeError(f"reward must return a float or a dict with 'reward', got {type(out).__name__}")
        value = float(out)
        if not math.isfinite(value):
            raise ValueError(f"reward returned a non-finite value {value}")
        sample.reward = value
        if extra:
            sample.metadata["rewards"] = extra
    except Exception as e:  # noqa: BLE001 - a reward fault fails the sample, never the loop
        _reward_failed(ctx, sample, e)


def _reward_failed(ctx: "RolloutContext", sample: Sample, e: BaseException) -> None:
    sample.status = FAILED
    sample.reward = None
    sample.metadata["error"] = f"reward: {type(e).__name__}: {e}"
    ctx.logger.warning("reward failed for %s: %s: %s", sample.uid, type(e).__name__, e)
