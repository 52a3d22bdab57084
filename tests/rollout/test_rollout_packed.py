"""The push reuses the arrays ``answers.check_answer`` made (``columns_push.Packed``), and only
while the samples' lists still hold exactly those values.

The in-process tests run the real functions of the default generator's group path on SGLang-shape
answers (``check_answer`` -> ``EngineClient.generate`` with the first answer given, so no engine is
called -> ``turn_fields`` -> the loop's model copy -> ``Packed.add``) and compare the push body
with the exact encoder's. The end-to-end test runs real processes (buffer, rollout service,
reference engine) with a reward that changes a sample's tokens in place: the buffer must hold the
changed tokens. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from headrace.rollout.columns_push import Packed, encode_groups
from headrace.rollout.generate import EngineClient, Gate, RolloutContext, turn_fields
from headrace.rollout.prompts import prompt_sample
from headrace.rollout.transport import check_answer
from headrace.shared import columns as cols
from headrace.shared.schemas import Group
from tests.rollout.support import generated

PROMPT = [11, 12, 13, 14, 15]
N_NEW = 200   # above answers._SHORT_ANSWER: the numpy check runs and keeps its arrays


def _answer(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150_000, N_NEW).tolist()
    lps = (-rng.exponential(1.0, N_NEW)).astype(np.float32).astype(np.float64).tolist()
    return {"text": f"t{seed}", "output_ids": ids, "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}


def _group(n: int = 3) -> tuple[Group, Packed]:
    """A group as ``RolloutLoop._generate_group`` makes it, with its ``Packed``."""
    client = EngineClient.__new__(EngineClient)   # what ``generate`` reads when its first answer is given
    client.gate, client.tokens_out, client.partial_held = Gate(), 0, 0
    first = prompt_sample(uid="g-0", group_id="g", tokens=list(PROMPT), prompt="p", label=None, metadata={})
    packed = Packed(first.tokens)
    samples = []
    for i in range(n):
        ctx = RolloutContext(None, None, None, logging.getLogger("t"))
        a = asyncio.run(client.generate(ctx, first.tokens, {"max_new_tokens": N_NEW},
                                        (check_answer(_answer(i), "http://e"), 0, 0)))
        assert a.arrays is not None, "a one-answer sample keeps the checked arrays"
        s = first.model_copy(update={"uid": f"g-{i}", "index": i, **turn_fields(first, a)})
        s.reward = float(i)
        packed.add(i, a["output_ids"], a.logprobs, a.arrays)
        samples.append(s)
    return Group.model_construct(group_id="g", samples=samples, metadata={}), packed


def _rows(body: bytes) -> list[dict[str, Any]]:
    return cols.decode(body)[0].to_rows()


def test_packed_arrays_encode_exactly_what_the_lists_hold() -> None:
    g, packed = _group()
    assert _rows(encode_groups([g], [packed])) == _rows(cols.encode([g])) == _rows(encode_groups([g]))
    assert packed.used == {0, 1, 2}, "the push converted the lists again"
    for i, s in enumerate(g.samples):
        got = packed.arrays_of(i, s)
        assert got is not None and got[0].tolist() == s.tokens[len(PROMPT):] and got[2].tolist() == s.rollout_logprobs


CHANGES: list[tuple[str, Callable[[Any], None]]] = [
    ("token replaced", lambda s: s.tokens.__setitem__(-3, 7)),
    ("prompt token replaced", lambda s: s.tokens.__setitem__(1, 99)),
    ("token appended", lambda s: (s.tokens.append(5), s.loss_mask.append(0), s.rollout_logprobs.append(0.0),
                                  setattr(s, "response_length", s.response_length + 1))),
    ("logprob replaced", lambda s: s.rollout_logprobs.__setitem__(4, -0.125)),
    ("mask zeroed", lambda s: s.loss_mask.__setitem__(0, 0)),
    ("lists rebound", lambda s: setattr(s, "tokens", list(reversed(s.tokens)))),
    ("logprobs dropped", lambda s: setattr(s, "rollout_logprobs", None)),
]


@pytest.mark.parametrize("change", [c for _, c in CHANGES], ids=[n for n, _ in CHANGES])
def test_a_sample_changed_in_place_is_encoded_from_its_lists(change: Callable[[Any], None]) -> None:
    """A reward or filter may change a sample after its arrays were made: the push then carries
    the changed values (the arrays of that sample are not used), the others keep theirs."""
    g, packed = _group()
    before = _rows(encode_groups([g], [packed]))
    change(g.samples[1])
    assert packed.arrays_of(1, g.samples[1]) is None
    assert packed.arrays_of(0, g.samples[0]) is not None and packed.arrays_of(2, g.samples[2]) is not None
    after = _rows(encode_groups([g], [packed]))
    assert after == _rows(cols.encode([g])) and after != before


def test_a_clamped_or_short_answer_keeps_no_arrays() -> None:
    a = _answer(0)
    a["meta_info"]["output_token_logprobs"][3][0] = 1e-9   # within rounding of 0: clamped to 0.0
    assert check_answer(a, "http://e").arrays is None
    short = {"text": "", "output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"},
                                                            "output_token_logprobs": [[-0.5, 1, None], [-0.25, 2, None]]}}
    assert check_answer(short, "http://e").arrays is None   # the short path checks without numpy


TOKEN_REWARD = '''
def reward(ctx, sample):
    if sample.index == 1:                       # in place, after the engine's answer was checked
        sample.tokens[-1] = 3
        sample.loss_mask[-1] = 0
    return 1.0
'''


def test_a_reward_changing_tokens_in_place_reaches_the_buffer(tmp_path: Path, tiny_model: Path, stacks) -> None:
    """Real buffer, rollout service and reference engine; answers of 150 tokens (numpy check,
    arrays kept): what the buffer stores is the sample as the reward left it."""
    s, (g,) = generated(stacks, tiny_model, tmp_path, TOKEN_REWARD, 1, prompts=2, n=3, max_new_tokens=150)
    for x in g.samples:
        assert x.response_length == 150 == len(x.rollout_logprobs)
        changed = x.index == 1
        assert (x.tokens[-1] == 3 and x.loss_mask[-1] == 0) if changed else sum(x.loss_mask) == 150
    st = s.status()
    assert st["counts"]["samples_failed"] == 0
    assert st["push"]["from_arrays"] == 2   # the unchanged samples went from their arrays
