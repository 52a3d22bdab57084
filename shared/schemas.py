"""Wire schemas shared by the rollout, buffer and trainer services.

One pydantic v2 model per message. Every invariant written in DESIGN.md ("Wire schemas") is
checked here, at the edge, so a receiver never has to re-check it: a Sample that validates has a
loss mask and logprobs of exactly ``response_length`` entries, finite rewards, and token ids that
are non-negative (and below ``vocab_size`` when the validation context carries one, e.g.
``Sample.model_validate(d, context={"vocab_size": 32000})``).

Validation errors name the field (pydantic's ``loc``), which services turn into 422 answers.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_GROUP_SIZE = 1024
MAX_INT = 2**63 - 1  # versions and counts are stored as SQLite INTEGERs (signed 64-bit)


class SampleStatus(str, Enum):
    """How a trajectory ended. ``failed`` samples carry no reward and are never trained on."""

    completed = "completed"
    truncated = "truncated"
    aborted = "aborted"
    failed = "failed"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_enum_values=True)


class Sample(_Wire):
    """One trajectory: prompt + response tokens and what the trainer needs to learn from them."""

    uid: str = Field(min_length=1, max_length=512, description="unique across the run; the idempotency key")
    group_id: str = Field(min_length=1, max_length=512, description="samples of one prompt share it")
    index: int = Field(default=0, ge=0, description="position in its group")
    tokens: list[int] = Field(description="prompt + response token ids, each in [0, vocab)")
    response_length: int = Field(default=0, ge=0, description="<= len(tokens)")
    loss_mask: list[int] = Field(default_factory=list, validate_default=True, description="len == response_length; 0/1 (0 = tool/env tokens)")
    rollout_logprobs: list[float] | None = Field(default=None, description="len == response_length; finite, <= 0")
    reward: float | None = Field(default=None, description="finite; null only when status is failed")
    status: SampleStatus = Field(default=SampleStatus.completed)
    weight_version: int = Field(default=0, ge=0, le=MAX_INT, description="oldest policy version that produced a response token")
    prompt: str | None = None
    response: str | None = None
    label: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("tokens")
    @classmethod
    def _tokens_in_vocab(cls, v: list[int], info: ValidationInfo) -> list[int]:
        if v and min(v) < 0:
            raise ValueError(f"token ids must be >= 0 (found {min(v)})")
        vocab = (info.context or {}).get("vocab_size") if info.context else None
        if vocab is not None and v and max(v) >= vocab:
            raise ValueError(f"token id {max(v)} is outside the vocabulary [0, {vocab})")
        return v

    # Length invariants are checked on the later field (fields validate in declaration order), so
    # a 422 names it: "groups[3].samples[1].loss_mask: len(loss_mask) (3) != response_length (4)".

    @field_validator("response_length")
    @classmethod
    def _response_within_tokens(cls, v: int, info: ValidationInfo) -> int:
        tokens = info.data.get("tokens")
        if tokens is not None and v > len(tokens):
            raise ValueError(f"response_length ({v}) exceeds len(tokens) ({len(tokens)})")
        return v

    @field_validator("loss_mask")
    @classmethod
    def _mask_binary(cls, v: list[int], info: ValidationInfo) -> list[int]:
        if v and not set(v) <= {0, 1}:
            raise ValueError("loss_mask values must be 0 or 1")
        n = info.data.get("response_length")
        if n is not None and len(v) != n:
            raise ValueError(f"len(loss_mask) ({len(v)}) != response_length ({n})")
        return v

    @field_validator("rollout_logprobs")
    @classmethod
    def _logprobs_nonpositive(cls, v: list[float] | None, info: ValidationInfo) -> list[float] | None:
        if v is None:
            return v
        if v and max(v) > 0.0:
            raise ValueError(f"rollout_logprobs must be <= 0 (found {max(v)})")
        n = info.data.get("response_length")
        if n is not None and len(v) != n:
            raise ValueError(f"len(rollout_logprobs) ({len(v)}) != response_length ({n})")
        return v

    @model_validator(mode="after")
    def _reward(self) -> "Sample":
        if self.reward is None and self.status != SampleStatus.failed.value:
            raise ValueError("reward: may be null only when status is 'failed'")
        if self.reward is not None and not math.isfinite(self.reward):  # allow_inf_nan guards JSON; be explicit
            raise ValueError("reward: must be finite")
        return self

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


class Group(_Wire):
    """All samples drawn for one prompt. Its weight_version is the minimum over its samples."""

    group_id: str = Field(min_length=1, max_length=512)
    samples: list[Sample] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> "Group":
        seen: set[int] = set()
        uids: set[str] = set()
        for i, s in enumerate(self.samples):
            if s.group_id != self.group_id:
                raise ValueError(f"samples[{i}].group_id {s.group_id!r} != group_id {self.group_id!r}")
            if s.index in seen:
                raise ValueError(f"samples[{i}].index {s.index} is repeated within the group")
            if s.uid in uids:
                raise ValueError(f"samples[{i}].uid {s.uid!r} is repeated within the group")
            seen.add(s.index)
            uids.add(s.uid)
        return self

    @property
    def weight_version(self) -> int:
        return min(s.weight_version for s in self.samples)


# ---- buffer API messages -------------------------------------------------------------------


class PostGroupsRequest(_Wire):
    groups: list[Group] = Field(min_length=1, description="all or nothing: one invalid group rejects the request")


class PostGroupsResponse(_Wire):
    accepted: int = Field(ge=0, description="groups newly queued")
    duplicates: int = Field(ge=0, description="groups whose group_id or a uid was seen before; not stored")
    evicted_stale: int = Field(default=0, ge=0, description="new groups already too stale: recorded, not queued")


class LeaseRequest(_Wire):
    groups: int = Field(ge=1, le=1_000_000, description="exactly this many groups, or 204")
    wait_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    lease_s: float = Field(default=600.0, gt=0.0, le=7 * 24 * 3600.0)
    min_weight_version: int | None = Field(default=None, ge=0, le=MAX_INT)


class LeaseResponse(_Wire):
    lease_id: str
    groups: list[Group]
    expires_at: float = Field(description="unix time at which the lease lapses")


class PolicyVersionRequest(_Wire):
    version: int = Field(ge=0, le=MAX_INT)


class ExtendLeaseRequest(_Wire):
    lease_s: float = Field(gt=0.0, le=7 * 24 * 3600.0, description="new deadline = now + lease_s")
    trained: bool = Field(default=False, description="the lease's step is trained, not yet checkpointed: held")


MAX_REASON = 2000


class RejectLeaseRequest(_Wire):
    group_ids: list[str] = Field(min_length=1, max_length=1_000_000, description="groups of this lease to dead-letter")
    reason: str = Field(min_length=1, max_length=MAX_REASON, description="why the trainer cannot use them")


class BufferStats(_Wire):
    queued: int
    leased: int
    held: int = Field(default=0, description="leased groups whose step is trained, awaiting its checkpoint")
    dead_lettered: int = Field(default=0, description="groups set aside by reject")
    consumed: int
    evicted_stale: int
    duplicates: int
    rejected: int
    throttled: int
    policy_version: int
    capacity: int
