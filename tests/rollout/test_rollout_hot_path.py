"""The rollout hot path without per-sample pydantic: generator output is checked as columns once
per group (rollout/columns_push.py), engine answers with numpy (rollout/answers.check_answer).

The end-to-end test runs real processes (buffer, rollout service, reference engine) with a
generator that breaks invariants and mutates its input: broken samples are failed with the row
schema's message, the mutation reaches no other sample. The others call the checks directly on
real Sample models and answer dicts (pure functions: nothing to mock).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from headrace.rollout.columns_push import check_outputs, copy_for_generator, encode_groups
from headrace.rollout.prompts import prompt_sample
from headrace.rollout.answers import Retryable, check_answer, logprobs_of
from headrace.shared import columns as cols
from headrace.shared.schemas import Group, Sample
from tests.rollout.support import generated


def _sample(**kw: object) -> Sample:
    s = prompt_sample(uid="g-0", group_id="g", tokens=[3, 4, 5], prompt="p", label=None, metadata={})
    fields = dict(tokens=[3, 4, 5, 6, 7], response_length=2, loss_mask=[1, 0], rollout_logprobs=[-0.5, 0.0],
                  status="truncated")
    fields.update(kw)
    for k, v in fields.items():
        setattr(s, k, v)
    return s


BROKEN = [
    (dict(loss_mask=[1, 0, 1]), "len(loss_mask) (3) != response_length (2)"),
    (dict(loss_mask=[1, 2]), "loss_mask values must be 0 or 1"),
    (dict(rollout_logprobs=[-0.5, 0.25]), "rollout_logprobs must be <= 0"),
    (dict(rollout_logprobs=[-0.5, float("nan")]), "rollout_logprobs"),
    (dict(rollout_logprobs=[-0.5]), "len(rollout_logprobs) (1) != response_length (2)"),
    (dict(tokens=[3, -4, 5, 6, 7]), "token ids must be >= 0"),
    (dict(tokens=[3, 4, 5, 6, 2**31]), "is not below 2^31"),
    (dict(tokens=[3, 4.5, 5, 6, 7]), "tokens.1"),
    (dict(tokens=[3, 4, 5, 6, "7"]), "tokens.4"),
    (dict(response_length=9, loss_mask=[1] * 9, rollout_logprobs=None), "exceeds len(tokens)"),
    (dict(status="bogus"), "status"),
    (dict(metadata={"t": b"bytes"}), "metadata"),
    (dict(label={1: "non-string key"}), "label"),
    (dict(prompt=7), "prompt"),
]


@pytest.mark.parametrize("change, needle", BROKEN, ids=[n for _, n in BROKEN])
def test_a_broken_sample_gets_the_schemas_message_and_only_it_fails(change: dict, needle: str) -> None:
    group = [_sample(), _sample(**change), _sample(rollout_logprobs=None)]
    out = check_outputs(group)
    assert out[0] == (group[0], None) and out[2] == (group[2], None)
    ok, why = out[1]
    assert ok is None and why is not None and needle in why, why


def test_samples_built_from_checked_parts_skip_only_the_per_token_pass() -> None:
    # the default generator's samples (tokenizer output + answers check_answer passed) are marked:
    # their token / mask / logprob lists are not walked again, every other field still is
    tokens_bad, status_bad = _sample(tokens=[3, -4, 5, 6, 7]), _sample(status="bogus")
    assert check_outputs([tokens_bad], [False])[0][0] is None        # not marked: walked and flagged
    assert check_outputs([tokens_bad], [True]) == [(tokens_bad, None)]   # marked: vouched for by the caller
    (ok, why), = check_outputs([status_bad], [True])
    assert ok is None and why is not None and "status" in why
    fine, mixed = _sample(), _sample(loss_mask=[1, 2])
    out = check_outputs([fine, mixed], [True, False])
    assert out[0] == (fine, None) and out[1][0] is None and "loss_mask values must be 0 or 1" in out[1][1]


def test_unusual_but_valid_values_are_normalised_by_the_schema() -> None:
    s = _sample(tokens=np.array([3, 4, 5, 6, 7]), loss_mask=[1, 1])
    (ok, why), = check_outputs([s])
    assert why is None and ok is not None and ok.tokens == [3, 4, 5, 6, 7] and type(ok.tokens) is list


def test_the_generators_copy_shares_nothing_mutable() -> None:
    base = prompt_sample(uid="g-0", group_id="g", tokens=[3, 4], prompt="p", label={"a": [1]},
                         metadata={"m": {"x": 1}, "k": 2})
    c = copy_for_generator(base)
    c.tokens.append(9)
    c.loss_mask.append(1)
    c.label["a"].append(2)
    c.metadata["m"]["x"] = 5
    c.metadata["new"] = 1
    assert base.tokens == [3, 4] and base.loss_mask == [] and base.label == {"a": [1]}
    assert base.metadata == {"m": {"x": 1}, "k": 2}


def test_a_cloned_sample_is_what_a_model_copy_with_the_update_gives() -> None:
    from headrace.rollout.columns_push import clone_sample

    base = prompt_sample(uid="g-0", group_id="g", tokens=[3, 4], prompt="p", label="7", metadata={"k": 1})
    update = {"uid": "g-3", "index": 3, "tokens": [3, 4, 9], "loss_mask": [1], "rollout_logprobs": [-0.5],
              "response_length": 1, "response": "x", "status": "truncated", "metadata": {"k": 1}}
    want, got = base.model_copy(update=update), clone_sample(base, update)
    assert type(got) is Sample and got.model_dump() == want.model_dump()
    assert got.model_fields_set == want.model_fields_set and got.__pydantic_extra__ is None
    assert got.__pydantic_private__ is None and got == want
    got.tokens.append(5)
    got.index = 4
    assert base.tokens == [3, 4] and base.index == 0 and base.uid == "g-0"
    assert Sample.model_validate({**got.model_dump(), "reward": 1.0}).index == 4
    # a model that carries private state is copied by pydantic itself, with it
    class Odd(Sample):
        model_config = {"extra": "allow"}
    odd = Odd.model_construct(**base.model_dump())
    object.__setattr__(odd, "__pydantic_extra__", {"note": 1})
    assert clone_sample(odd, {"index": 2}).__pydantic_extra__ == {"note": 1}


def test_an_appended_turn_is_new_values_over_the_metadata_the_sample_will_own() -> None:
    """``turn_fields`` (the group path's one copy per sample, and ``append_turn``): nothing of the
    prompt sample changes, and a resumed answer's count goes onto the metadata copy given."""
    from headrace.rollout.columns_push import own_free_form
    from headrace.rollout.generate import append_turn, turn_fields

    base = prompt_sample(uid="g-0", group_id="g", tokens=[3, 4], prompt="p", label={"a": [1]},
                         metadata={"m": {"x": 1}, "resumed": 1})
    answer = {"text": "xy", "output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "stop"}, "segments": 3,
                                                              "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}}
    own = own_free_form(base)
    f = turn_fields(base, answer, own["metadata"])
    assert (f["tokens"], f["loss_mask"], f["rollout_logprobs"], f["response_length"], f["response"], f["status"]) == \
        ([3, 4, 7, 8], [1, 1], [-0.5, -0.25], 2, "xy", "completed")
    assert f["metadata"] == {"m": {"x": 1}, "resumed": 3} and f["metadata"]["m"] is own["metadata"]["m"]
    assert f["metadata"]["m"] is not base.metadata["m"] and own["label"] is not base.label
    assert base.tokens == [3, 4] and base.loss_mask == [] and base.metadata == {"m": {"x": 1}, "resumed": 1}
    mine = copy_for_generator(base)
    assert append_turn(mine, answer) is mine and mine.tokens == [3, 4, 7, 8] and mine.metadata["resumed"] == 3


def _answer(ids: list, lps: list) -> dict:
    return {"text": "", "output_ids": ids, "meta_info": {"finish_reason": {"type": "length"},
                                                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}


@pytest.mark.parametrize("ids, lps", [([1, -2], [-0.1, -0.2]), ([1, 2**31], [-0.1, -0.2]),
                                      ([1, 2.5], [-0.1, -0.2]), ([1, "2"], [-0.1, -0.2]),
                                      ([1, 2], [-0.1, 0.5]), ([1, 2], [-0.1, float("inf")]), ([1, 2], [-0.1, "x"]),
                                      ([1, 2], [-0.1, None])])
def test_garbage_engine_answers_are_retryable(ids: list, lps: list) -> None:
    with pytest.raises(Retryable):
        check_answer(_answer(ids, lps), "http://e")


def test_a_good_answer_passes_and_rounding_above_zero_is_clamped() -> None:
    out = check_answer(_answer([1, 2, 3], [-0.1, 5e-7, 0]), "http://e")
    assert [x[0] for x in out["meta_info"]["output_token_logprobs"]] == [-0.1, 0.0, 0]
    assert logprobs_of(out) == [-0.1, 0.0, 0]
    out["meta_info"]["output_token_logprobs"] = [[-0.5, 1, None], [-0.5, 2, None], [-0.5, 3, None]]
    assert logprobs_of(out) == [-0.5] * 3          # entries replaced: read again, never a stale copy
    assert check_answer(_answer([], []), "http://e")["output_ids"] == []


_VALUES = [0, 1, 7, -1, 2**31 - 1, 2**31, 2**70, 2.5, -0.0, 0.0, -0.1, -3.25, 5e-7, 1e-5, 0.5, -1e308,
           float("nan"), float("inf"), float("-inf"), True, False, None, "x", [], [-0.1], {}]


def _entries(draw: object, n: int) -> list:
    from hypothesis import strategies as st
    value = st.sampled_from(_VALUES)
    entry = st.one_of(st.builds(lambda lp, t: [lp, t, None], value, value), value, st.just([]))
    return draw(st.lists(entry, min_size=n, max_size=n))  # type: ignore[operator]


def _outcome(out: dict) -> object:
    import copy

    from headrace.rollout import answers
    try:
        a = answers.check_answer(copy.deepcopy(out), "http://e")
    except Retryable as e:
        return ("error", str(e))
    return ("ok", a["output_ids"], repr(a["meta_info"]["output_token_logprobs"]), repr(logprobs_of(a)))


def test_short_answers_are_judged_exactly_as_the_numpy_path_judges_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_answer`` tries a plain-Python pass on answers of a few tokens; whatever it is given,
    the outcome (checked lists, clamping, or the error and its wording) is the numpy path's."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from headrace.rollout import answers

    @st.composite
    def answer_dicts(draw: st.DrawFn) -> dict:
        n = draw(st.integers(0, 6))
        pool = draw(st.sampled_from([st.integers(0, 5000), st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, True]),
                                     st.sampled_from(_VALUES)]))
        ids = draw(st.lists(pool, min_size=n, max_size=n))
        if draw(st.booleans()):
            lps = [[draw(st.floats(max_value=0.0, allow_nan=False)), t, None] for t in ids]
        else:
            lps = _entries(draw, n)
        return {"text": "", "output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"},
                                                            "output_token_logprobs": lps}}

    short = answers._SHORT_ANSWER
    seen = {"ok": 0, "error": 0}

    @settings(max_examples=600, deadline=None, database=None)
    @given(answer_dicts())
    def same(out: dict) -> None:
        monkeypatch.setattr(answers, "_SHORT_ANSWER", short)
        fast = _outcome(out)
        monkeypatch.setattr(answers, "_SHORT_ANSWER", -1)   # every answer through numpy
        assert fast == _outcome(out)
        seen[fast[0]] += 1

    same()
    assert seen["ok"] > 20 and seen["error"] > 20, seen   # both outcomes were exercised


@pytest.mark.parametrize("answers_per_batch, rare", [((1, 5), 10), ((20, 40), 300)])   # (past answers._NUMPY_FROM values)
def test_a_batch_of_short_answers_checked_at_once_is_judged_as_each_alone(answers_per_batch: tuple[int, int],
                                                                          rare: int) -> None:
    """``answers.check_short_batch`` (a batch answer's short answers, one pass): either every
    answer comes out as ``check_answer`` makes it, or None with the answers untouched (each then
    goes through ``check_answer``, which words the errors)."""
    import copy

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from headrace.rollout import answers

    @st.composite
    def batches(draw: st.DrawFn) -> list:
        outs = []
        for _ in range(draw(st.integers(*answers_per_batch))):
            ids = draw(st.lists(st.integers(0, 5000), min_size=0 if draw(st.integers(0, rare - 1)) == 0 else 1,
                                max_size=6))
            lps = [[draw(st.floats(-1e6, 0.0)), t, None] for t in ids]
            if ids and draw(st.integers(0, rare - 1)) == 0:   # now and then one bad value somewhere
                k = draw(st.integers(0, len(ids) - 1))
                if draw(st.booleans()):
                    ids[k] = draw(st.sampled_from([v for v in _VALUES if not isinstance(v, int) or v < 0 or v >= 2**31]))
                else:
                    lps[k] = draw(st.sampled_from([[5e-7, ids[k], None], [0.5, ids[k], None], [None, ids[k], None], "x",
                                                   [float("-inf"), ids[k], None]]))
            fr = draw(st.sampled_from([{"type": "length"}, "stop", {"type": "abort"}]))
            if draw(st.integers(0, rare - 1)) == 0:
                fr = {"type": "bogus"}
            outs.append({"text": "t", "output_ids": ids, "meta_info": {"finish_reason": fr, "output_token_logprobs": lps}})
        return outs

    seen = {"batch": 0, "alone": 0}

    @settings(max_examples=400, deadline=None, database=None)
    @given(batches())
    def same(outs: list) -> None:
        given_outs = copy.deepcopy(outs)
        got = answers.check_short_batch(outs)
        if got is None:
            assert outs == given_outs   # nothing changed: each goes through check_answer
            seen["alone"] += 1
            return
        seen["batch"] += 1
        for a, out in zip(got, given_outs):
            want = answers.check_answer(out, "http://e")
            assert (type(a), dict(a), a.entries, a.logprobs, a.arrays) == (type(want), dict(want), want.entries,
                                                                           want.logprobs, want.arrays)

    same()
    assert seen["batch"] > 20 and seen["alone"] > 20, seen


@pytest.mark.parametrize("bad", [None, ("id", 2**31), ("id", -1), ("lp", 1e-3), ("lp", float("nan")),
                                 ("lp", float("-inf"))])
def test_a_large_batch_is_refused_for_any_one_bad_value(bad: tuple | None) -> None:
    """Past ``answers._NUMPY_FROM`` joined values the batch check reduces with numpy: one id out of
    range or one logprob that is positive or not finite anywhere sends every answer to ``check_answer``."""
    from headrace.rollout import answers

    outs = [{"text": "t", "output_ids": [7 + j, 8, 9, 10], "meta_info": {"finish_reason": "length",
             "output_token_logprobs": [[-0.5, t, None] for t in (7 + j, 8, 9, 10)]}} for j in range(32)]
    assert 32 * 4 >= answers._NUMPY_FROM
    if bad is not None:
        where = outs[17]
        if bad[0] == "id":
            where["output_ids"][2] = bad[1]
        else:
            where["meta_info"]["output_token_logprobs"][3][0] = bad[1]
    got = answers.check_short_batch(outs)
    assert (got is None) == (bad is not None)


def _group(gid: str, n: int = 3, **kw: object) -> Group:
    samples = []
    for i in range(n):
        x = _sample(**kw)
        x.uid, x.group_id, x.index, x.reward, x.weight_version = f"{gid}-{i}", gid, i, float(i), 2
        samples.append(x)
    samples[0].rollout_logprobs = None
    samples[-1].status, samples[-1].reward, samples[-1].label = "failed", None, {"a": [1, {"b": None}]}
    samples[-1].metadata = {"error": "x"}
    return Group.model_construct(group_id=gid, samples=samples, metadata={"epoch": 0})


def test_the_push_body_carries_what_the_exact_encoder_does() -> None:
    groups = [_group("a"), _group("b", 1), _group("c", 4)]
    mine, _ = cols.decode(encode_groups(groups))
    exact, _ = cols.decode(cols.encode(groups))
    assert mine.to_rows() == exact.to_rows()


@pytest.mark.parametrize("change", [dict(tokens=[3, 4, 5, 6, 7.5]), dict(rollout_logprobs=[-0.5, 1e-50]),
                                    dict(loss_mask=[1, "1"])], ids=["float token", "tiny positive", "str mask"])
def test_values_columns_cannot_carry_go_to_the_exact_encoder(change: dict) -> None:
    with pytest.raises(cols.NotColumnar):     # the pusher then sends rows, and the buffer names the field
        encode_groups([_group("a", **change)])


GENERATOR = '''
from headrace.rollout.generate import append_turn

async def generate(ctx, sample, sampling):
    prompt = list(sample.tokens)
    sample.tokens.insert(0, 1)                  # mutate the input in place: its own copy only
    sample.label["mine"] = sample.index
    sample.metadata["mine"] = sample.index
    del sample.tokens[0]
    append_turn(sample, await ctx.generate(prompt, sampling))
    if sample.index == 1:
        sample.loss_mask = sample.loss_mask + [1]
    if sample.index == 2:
        sample.rollout_logprobs = [0.5] * sample.response_length
    return sample
'''

REWARD = '''
def reward(ctx, sample):
    return 0.0
'''


def test_invalid_samples_fail_with_the_schemas_message_and_mutations_stay_local(tmp_path: Path, tiny_model: Path,
                                                                                 stacks) -> None:
    (tmp_path / "gen.py").write_text(GENERATOR)
    s, [group] = generated(stacks, tiny_model, tmp_path, REWARD, 1, prompts=4, n=4, max_new_tokens=4,
                           generate=f"{tmp_path}/gen.py:generate")
    by = {x.index: x for x in group.samples}
    prompt = by[0].tokens[:by[0].prompt_length]
    for i in (0, 3):
        x = by[i]
        assert x.status == "truncated" and x.reward == 0.0 and x.response_length == 4
        assert x.label == {"answer": "0", "mine": i} and x.metadata["mine"] == i and x.tokens[:len(prompt)] == prompt
    assert by[1].status == "failed" and by[1].reward is None
    assert by[1].metadata["error"] == ("generator produced an invalid sample: loss_mask: Value error, "
                                       "len(loss_mask) (5) != response_length (4)")
    assert by[2].status == "failed" and "rollout_logprobs" in by[2].metadata["error"]
    assert by[1].tokens == by[2].tokens == prompt and by[1].label == {"answer": "0"}   # the untouched prompt sample
    assert s.status()["counts"]["samples_failed"] == 2


MUTATING_REWARD = '''
def reward(ctx, sample):
    sample.metadata["seen"] = sample.metadata.get("seen", 0) + 1   # in place: must not reach a sibling
    sample.label["mine"] = sample.index
    return float(sample.index)
'''


def test_the_default_generators_group_samples_share_nothing_mutable(tmp_path: Path, tiny_model: Path, stacks) -> None:
    """The default generator's group path (``RolloutLoop._generate_group``: one model copy per
    sample): right ids, prompt and response, and a reward that mutates its sample's label and
    metadata in place reaches that sample only."""
    s, groups = generated(stacks, tiny_model, tmp_path, MUTATING_REWARD, 2, prompts=4, n=4, max_new_tokens=4)
    for g in groups:
        prompt = g.samples[0].tokens[:g.samples[0].prompt_length]
        for i, x in enumerate(g.samples):
            assert (x.index, x.uid, x.group_id) == (i, f"{g.group_id}-{i}", g.group_id)
            assert x.status == "truncated" and x.response_length == 4 == len(x.rollout_logprobs) == sum(x.loss_mask)
            assert x.tokens[:len(prompt)] == prompt and len(x.tokens) == len(prompt) + 4 and x.response
            assert x.reward == float(i) and x.metadata["seen"] == 1 and x.label["mine"] == i
    assert s.status()["counts"]["samples_failed"] == 0


def _finishing(reward: object, n: int) -> tuple[object, list]:
    """A ``RolloutLoop`` holding only what ``_finish`` reads, and ``n`` generated samples for it."""
    import logging
    from types import SimpleNamespace

    from headrace.rollout.generate import Gate, RolloutContext
    from headrace.rollout.loop import RolloutLoop

    loop = RolloutLoop.__new__(RolloutLoop)
    loop.reward_fn, loop.rc, loop.gate = reward, SimpleNamespace(reward_timeout_s=10.0), Gate(version=3)
    made = []
    for i in range(n):
        s = _sample(uid=f"g-{i}", index=i)
        made.append((RolloutContext(None, None, None, logging.getLogger("t")), s, [s], True))
    return loop, made


def _busy(slices: float) -> None:
    import time

    from headrace.rollout.loop import REWARD_SLICE_S
    t = time.perf_counter()
    while time.perf_counter() - t < slices * REWARD_SLICE_S:
        pass


def test_plain_rewards_run_inline_yet_the_loop_gets_turns_and_async_ones_overlap() -> None:
    """``RolloutLoop._finish`` (the real method, on a loop object holding only what it reads):
    plain rewards are applied inline, and a slow one still lets the event loop run between
    samples; async rewards of a group run concurrently; failures stay per sample."""
    import asyncio

    def busy(ctx: object, s: Sample) -> float:   # a plain reward that holds the loop ~2 slices
        _busy(2)
        return 1.0

    active = peak = 0

    async def slow_async(ctx: object, s: Sample) -> float:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.05)
        active -= 1
        return 0.5

    def crash_on_second(ctx: object, s: Sample) -> float:
        if s.uid.endswith("-1"):
            raise RuntimeError("boom")
        return 2.0

    async def finish(reward: object, n: int) -> tuple[list[Sample], int]:
        loop, made = _finishing(reward, n)
        turns = 0

        async def tick() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        out = await loop._finish(made)
        ticker.cancel()
        return out, turns

    out, turns = asyncio.run(finish(busy, 8))
    assert [s.reward for s in out] == [1.0] * 8 and all(s.weight_version == 3 for s in out)
    assert turns >= 4, f"the event loop ran {turns} times while 8 slow plain rewards ran"
    out, _ = asyncio.run(finish(slow_async, 8))
    assert [s.reward for s in out] == [0.5] * 8 and peak == 8   # all of the group's async rewards at once
    out, _ = asyncio.run(finish(crash_on_second, 3))
    assert [s.reward for s in out] == [2.0, None, 2.0] and out[1].status == "failed"
    assert "reward: RuntimeError: boom" in out[1].metadata["error"]


def test_a_finish_cancelled_between_rewards_leaves_no_reward_unawaited() -> None:
    """Cancelled while a slow plain reward let the loop in, ``_finish`` discards the async rewards
    it had not started: they never run and no "coroutine was never awaited" warning is left."""
    import asyncio
    import gc
    import warnings

    ran = []

    async def later() -> float:
        ran.append(1)
        return 1.0

    def mixed(ctx: object, s: Sample) -> object:   # sample 0 async, the others plain and slow
        if s.index == 0:
            return later()
        _busy(2)
        return 1.0

    async def main() -> None:
        loop, made = _finishing(mixed, 4)
        task = asyncio.create_task(loop._finish(made))
        await asyncio.sleep(0)    # _finish runs up to its first turn for the loop (after sample 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert ran == [] and not [w for w in caught if "never awaited" in str(w.message)], caught


def test_the_loop_collects_cyclic_garbage_on_its_clock_whatever_the_gc_threshold() -> None:
    # RolloutLoop.start raises the GC's first threshold to GC_THRESHOLD (collections of the live
    # answers cost ~280 ms each at scale), so a cycle may wait for the full collection that
    # flush_cursor runs every GC_EVERY_S through collect_garbage
    import gc
    import weakref

    from headrace.rollout.loop import GC_EVERY_S, GC_THRESHOLD, collect_garbage

    class Node:
        pass

    old = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, *old[1:])
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a   # a cycle: only the cyclic GC frees it
        gone = weakref.ref(a)
        del a, b
        assert collect_garbage(100.0, 100.0 + GC_EVERY_S / 2) == 100.0   # too soon: nothing collected
        assert gone() is not None
        assert collect_garbage(100.0, 100.0 + GC_EVERY_S) == 100.0 + GC_EVERY_S
        assert gone() is None
    finally:
        gc.set_threshold(*old)


def test_the_cursor_is_written_between_batch_rounds_or_when_one_runs_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """``flush_cursor`` skips its writes while a ``generate_batch`` round holds the batch lock, for
    at most ``QUIET_IN_BATCH_S``."""
    import asyncio
    import time

    from headrace.rollout import loop as loop_mod

    class Data:
        def __init__(self) -> None:
            self.writes: list[float] = []

        def flush(self) -> None:
            self.writes.append(time.monotonic())

    class Loop:
        def __init__(self) -> None:
            self.data = Data()
            self._batch_lock = asyncio.Lock()

    async def main(quiet_s: float) -> tuple[list[float], float, float]:
        monkeypatch.setattr(loop_mod, "QUIET_IN_BATCH_S", quiet_s)
        fake = Loop()
        await fake._batch_lock.acquire()           # a round is running
        task = asyncio.create_task(loop_mod.RolloutLoop.flush_cursor(fake))
        t0 = time.monotonic()
        await asyncio.sleep(1.1)
        fake._batch_lock.release()                 # the round ends
        t1 = time.monotonic()
        await asyncio.sleep(0.5)
        task.cancel()
        return [w - t0 for w in fake.data.writes], t1 - t0, time.monotonic() - t0

    writes, ended, _ = asyncio.run(main(10.0))
    assert writes and all(w >= ended for w in writes)      # none during the round, then every tick
    writes, ended, _ = asyncio.run(main(0.5))
    during = [w for w in writes if w < ended]
    assert 1 <= len(during) <= 2 and during[0] >= 0.5      # a long round: at most every 0.5 s
