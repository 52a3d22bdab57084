"""Example reward: exact match on the last number of the response, with a small length penalty.

``rollout.reward: examples/custom_reward.py:reward``. Returns a dict: ``reward`` is what the
trainer uses; the other entries are logged in ``sample.metadata["rewards"]``.
"""

from __future__ import annotations

import re

from headrace.rollout.generate import RolloutContext
from headrace.shared.schemas import Sample

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PENALTY_PER_TOKEN = 0.001


async def reward(ctx: RolloutContext, sample: Sample) -> dict[str, float]:
    numbers = NUMBER.findall(sample.response or "")
    correct = float(bool(numbers) and sample.label is not None and numbers[-1] == str(sample.label).strip())
    penalty = PENALTY_PER_TOKEN * sample.response_length
    return {"reward": correct - penalty, "correct": correct, "length_penalty": penalty}
