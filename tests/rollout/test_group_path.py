"""``rollout.group_path.group_samples``: a default-generator group built in one pass is what the
generic copy (``clone_sample`` over ``own_free_form`` and ``turn_fields``) gives each sample, owns
everything mutable, and says how much of it is valid by construction; ``check_outputs`` trusts
``ALL_VALID`` and checks the rest (pure functions: answers as ``answers.check_answer`` makes them)."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from headrace.rollout.answers import Answer, check_answer
from headrace.rollout.columns_push import ALL_VALID, NUMBERS_VALID, Packed, check_outputs, clone_sample, own_free_form
from headrace.rollout.generate import turn_fields
from headrace.rollout.group_path import group_samples
from headrace.rollout.prompts import prompt_sample
from headrace.shared.schemas import Sample

LOG = logging.getLogger("test.group_path")


def _answer(k: int, text: Any = "ok", segments: int | None = None, reason: str = "stop") -> Answer:
    ids = [10 + k, 20 + k, 30 + k]
    out = {"text": text, "output_ids": ids, "meta_info": {
        "finish_reason": {"type": reason}, "output_token_logprobs": [[-0.5 * (j + 1), t, None] for j, t in enumerate(ids)]}}
    a = check_answer(out, "http://engine")
    if segments is not None:
        a["meta_info"]["segments"] = segments
    assert isinstance(a, Answer)
    return a


def _ctxs(n: int, versions: list[int | None] | None = None) -> list[Any]:
    return [SimpleNamespace(weight_version=(versions or [None] * n)[i]) for i in range(n)]


def _generic(first: Sample, i: int, a: Any, v: int) -> Sample:
    own = own_free_form(first)
    return clone_sample(first, {"uid": f"{first.group_id}-{i}", "index": i, **own,
                                **turn_fields(first, a, own["metadata"]), "weight_version": v})


def _first(**kw: Any) -> Sample:
    fields = {"uid": "g-0", "group_id": "g", "tokens": [1, 2, 3], "prompt": "p", "label": "7",
              "metadata": {"k": 1}, "weight_version": 4, **kw}
    return prompt_sample(**fields)


@pytest.mark.parametrize("first", [
    _first(),                                                          # the usual one: the fast copy
    _first(label={"answer": [7]}, metadata={"m": {"x": [1]}}),         # container free-form: the generic path
    _first(metadata={}),
])
def test_each_sample_is_what_the_generic_copy_gives_and_owns_its_parts(first: Sample) -> None:
    answers: list[Any] = [_answer(0), _answer(1, reason="length"), _answer(2, segments=3), _answer(3, text=None)]
    ctxs = _ctxs(4, [None, 2, None, 1])
    keep = copy.deepcopy(first.__dict__)
    made = group_samples(first, ctxs, [copy.deepcopy(a) for a in answers], 9, Packed(first.tokens), LOG)
    assert first.__dict__ == keep                                         # nothing of the prompt sample changed
    for i, ((ctx, base, outs, _), a) in enumerate(zip(made, answers)):
        want = _generic(first, i, copy.deepcopy(a), [9, 2, 9, 1][i])
        (s,) = outs
        assert ctx is ctxs[i] and base is s and type(s) is Sample
        assert s.__dict__ == want.__dict__ and list(s.__dict__) == list(want.__dict__)
        assert s.model_fields_set == want.model_fields_set and s.__pydantic_extra__ is None
    assert made[2][2][0].metadata["resumed"] == 2                         # a resumed answer counts its segments
    a, b = made[0][2][0], made[1][2][0]
    a.tokens.append(99)
    a.loss_mask.append(0)
    a.rollout_logprobs.append(-1.0)
    a.metadata["new"] = 1
    if isinstance(a.label, dict):
        a.label["answer"].append(8)
    assert first.tokens == [1, 2, 3] and first.loss_mask == [] and "new" not in first.metadata
    assert b.tokens == [1, 2, 3, 11, 21, 31] and "new" not in b.metadata and b.label == keep["label"]


def test_validity_marks_and_what_check_outputs_makes_of_them() -> None:
    first = _first()
    answers: list[Any] = [_answer(0), _answer(1, text=5), _answer(2)]
    made = group_samples(first, _ctxs(3), answers, 0, Packed(first.tokens), LOG)
    assert [m[3] for m in made] == [ALL_VALID, 0, ALL_VALID]   # a text that is no string fails its sample
    assert made[1][2][0].status == "failed" and "generate: TypeError" in made[1][2][0].metadata["error"]
    want = _generic(first, 1, _answer(1, text="x"), 0)   # (the generic path fails it alike)
    with pytest.raises(TypeError):
        turn_fields(first, _answer(1, text=5))
    assert want.response == "x"
    samples = [m[2][0] for m in made]
    out = check_outputs(samples, [m[3] for m in made])
    assert out == [(s, None) for s in samples]
    # a prompt sample whose own fields break the schema: no sample of the group is marked all valid
    odd = _first(prompt=3)
    made = group_samples(odd, _ctxs(2), [_answer(0), _answer(1)], 0, Packed(odd.tokens), LOG)
    assert [m[3] for m in made] == [NUMBERS_VALID, NUMBERS_VALID]
    assert all(why and "prompt" in why for _, why in check_outputs([m[2][0] for m in made], [m[3] for m in made]))
    # ALL_VALID is trusted (the group path's promise), anything less is checked
    broken = samples[0].model_copy(update={"response_length": 7})
    assert check_outputs([broken], [ALL_VALID]) == [(broken, None)]
    assert check_outputs([broken], [NUMBERS_VALID])[0][0] is None


def test_a_failed_answer_fails_its_sample_only_with_the_generators_message() -> None:
    first = _first()
    answers: list[Any] = [_answer(0), RuntimeError("engine gone"), {"no": "answer"}]
    made = group_samples(first, _ctxs(3), answers, 0, Packed(first.tokens), LOG)
    assert made[0][3] == ALL_VALID and made[0][2][0].status == "completed"
    for i in (1, 2):
        ctx, base, (s,), valid = made[i]
        assert valid == 0 and s.status == "failed" and s.uid == f"g-{i}" and s.index == i and base.uid == f"g-{i}"
        assert s.tokens == [1, 2, 3] and s.metadata["error"].startswith("generate: ")
    assert "engine gone" in made[1][2][0].metadata["error"] and "KeyError" in made[2][2][0].metadata["error"]


def test_long_answers_hand_their_checked_arrays_to_the_push() -> None:
    first = _first()
    ids = list(range(5, 5 + 200))
    out = {"text": "x", "output_ids": ids, "meta_info": {"finish_reason": {"type": "length"},
                                                         "output_token_logprobs": [[-0.1, t, None] for t in ids]}}
    a = check_answer(out, "http://engine")
    assert getattr(a, "arrays", None) is not None
    packed = Packed(first.tokens)
    (made,) = group_samples(first, _ctxs(1), [a], 0, packed, LOG)
    s = made[2][0]
    assert s.rollout_logprobs is not a.logprobs and s.tokens[3:] == ids
    got = packed.arrays_of(0, s)
    assert got is not None and got[0].tolist() == ids
