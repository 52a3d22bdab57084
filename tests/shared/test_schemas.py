"""Wire schemas: every invariant of DESIGN.md "Wire schemas" accepted or refused, with the field named."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from headrace.shared.schemas import (BufferStats, Group, LeaseRequest, LeaseResponse, PolicyVersionRequest,
                            PostGroupsRequest, PostGroupsResponse, Sample)
from headrace.shared.wire import format_validation_error


def sample(**kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = dict(uid="u", group_id="g", index=0, tokens=[5, 6, 7, 8], response_length=2,
                             loss_mask=[1, 0], rollout_logprobs=[-0.1, -2.0], reward=0.5, weight_version=1)
    d.update(kw)
    return d


def error_of(model: Any, data: Any, **kw: Any) -> str:
    with pytest.raises(ValidationError) as e:
        model.model_validate(data, **kw)
    return format_validation_error(e.value)


def test_valid_sample_and_defaults() -> None:
    s = Sample.model_validate(sample())
    assert s.prompt_length == 2 and s.status == "completed" and s.metadata == {}
    bare = Sample(uid="u", group_id="g", tokens=[1, 2], reward=0.0)
    assert bare.response_length == 0 and bare.loss_mask == [] and bare.rollout_logprobs is None
    failed = Sample.model_validate(sample(reward=None, status="failed"))
    assert failed.reward is None
    assert Sample.model_validate(sample(label={"x": [1]}, metadata={"a": 1}, prompt="p", response="r")).label == {"x": [1]}


@pytest.mark.parametrize("change, field", [
    (dict(loss_mask=[1]), "loss_mask"),
    (dict(loss_mask=[1, 2]), "loss_mask"),
    (dict(rollout_logprobs=[-1.0]), "rollout_logprobs"),
    (dict(rollout_logprobs=[-1.0, 0.1]), "rollout_logprobs"),
    (dict(rollout_logprobs=[-1.0, -math.inf]), "rollout_logprobs"),
    (dict(response_length=5, loss_mask=[1] * 5), "response_length"),
    (dict(response_length=-1), "response_length"),
    (dict(tokens=[1, -2, 3, 4]), "tokens"),
    (dict(reward=math.nan), "reward"),
    (dict(reward=math.inf), "reward"),
    (dict(reward=None), "reward"),
    (dict(status="exploded"), "status"),
    (dict(weight_version=-1), "weight_version"),
    (dict(weight_version=2**63), "weight_version"),
    (dict(index=-1), "index"),
    (dict(uid=""), "uid"),
    (dict(extra_field=1), "extra_field"),
])
def test_sample_invariants_name_the_field(change: dict[str, Any], field: str) -> None:
    assert field in error_of(Sample, sample(**change))


def test_vocab_bound_from_context() -> None:
    Sample.model_validate(sample(), context={"vocab_size": 9})
    assert "outside the vocabulary" in error_of(Sample, sample(), context={"vocab_size": 8})


def test_group_invariants() -> None:
    g = Group.model_validate({"group_id": "g", "samples": [sample(uid="a", weight_version=3), sample(uid="b", index=1)]})
    assert g.weight_version == 1  # the minimum over samples
    assert "samples" in error_of(Group, {"group_id": "g", "samples": []})
    assert "samples[1].group_id" in error_of(Group, {"group_id": "g", "samples": [sample(uid="a"), sample(uid="b", index=1, group_id="h")]})
    assert "samples[1].index" in error_of(Group, {"group_id": "g", "samples": [sample(uid="a"), sample(uid="b")]})
    assert "samples[1].uid" in error_of(Group, {"group_id": "g", "samples": [sample(), sample(index=1)]})
    too_many = {"group_id": "g", "samples": [sample(uid=str(i), index=i) for i in range(1025)]}
    assert "samples" in error_of(Group, too_many)


def test_request_errors_carry_group_and_sample_index() -> None:
    ok = {"group_id": "g", "samples": [sample()]}
    bad = {"group_id": "h", "samples": [sample(group_id="h"), sample(uid="v", index=1, group_id="h", loss_mask=[1])]}
    msg = error_of(PostGroupsRequest, {"groups": [ok, bad]})
    assert msg.startswith("groups[1].samples[1].loss_mask: ")
    assert "groups" in error_of(PostGroupsRequest, {"groups": []})


def test_api_messages() -> None:
    assert LeaseRequest.model_validate({"groups": 4}).lease_s == 600.0
    for bad in ({"groups": 0}, {"groups": 1, "wait_s": -1}, {"groups": 1, "lease_s": 0}, {"groups": 1, "min_weight_version": -1}):
        with pytest.raises(ValidationError):
            LeaseRequest.model_validate(bad)
    with pytest.raises(ValidationError):
        PolicyVersionRequest.model_validate({"version": -1})
    assert PostGroupsResponse.model_validate({"accepted": 1, "duplicates": 0}).evicted_stale == 0
    LeaseResponse.model_validate({"lease_id": "x", "groups": [{"group_id": "g", "samples": [sample()]}], "expires_at": 1.0})
    BufferStats.model_validate(dict(queued=0, leased=0, consumed=0, evicted_stale=0, duplicates=0, rejected=0,
                                    throttled=0, policy_version=0, capacity=1))
