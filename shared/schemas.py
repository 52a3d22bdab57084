"""Wire schemas shared by the rollout, buffer and trainer services.

One pydantic v2 model per message. Every invariant written in DESIGN.md ("Wire schemas") is
checked here, at the edge, so a receiver never has to re-check it: a Sample that validates has a
loss mask and logprobs of exactly ``response_length`` entries, finite rewards, and token ids that
are non-negative (and below ``vocab_size`` when the validation context carries one, e.g.
``Sample.model_validate(d, context={"vocab_size": 32000})``).

Validation errors name the field (pydantic's ``loc``), which services turn into 422 answers.

Strict at the wire: what JSON or msgpack can carry is taken only as its own type. Integer fields
(token ids, indices, versions, counts) take integers, not ``"7"``, ``true`` or ``3.0``; float
fields take numbers (an integer is a number) but not booleans or strings; strings are not bytes;
token ids lie in [0, 2^31). (Python producers may still pass numpy integers: only the coercions a
decoded body could ask for are refused.) Free-form fields (``label``, ``metadata``) hold plain
JSON values only -- no msgpack extension (Timestamp), no bytes, no non-string keys, integers
within 64 bits, at most ``MAX_FREEFORM_DEPTH`` levels -- so every accepted group can be written
back out as JSON and as msgpack.
"""

from __future__ import annotations

import math
import operator
from enum import Enum
from typing import Annotated, Any

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationInfo, field_validator, model_validator)

MAX_GROUP_SIZE = 1024
MAX_INT = 2**63 - 1  # versions and counts are stored as SQLite INTEGERs (signed 64-bit)
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 in columns and tensors
MAX_FREEFORM_DEPTH = 32  # nesting of label / metadata; JSON writers stop at ~255 levels
_NOT_INT = (bool, float, str, bytes, bytearray)
_NOT_FLOAT = (bool, str, bytes, bytearray)


def _type_error(v: Any, want: str) -> ValueError:
    return ValueError(f"must be {want}, not {type(v).__name__} {str(v)[:40]!r}")


def _int_only(v: Any) -> Any:
    if isinstance(v, _NOT_INT):
        raise _type_error(v, "an integer")
    return v


def _number_only(v: Any) -> Any:
    if isinstance(v, _NOT_FLOAT):
        raise _type_error(v, "a number")
    return v


_WIRE_TYPES = (type(None), bool, int, float, str, bytes, list, dict)


def _python_numbers(convert: Any) -> Any:
    """Lists from a decoded body go to pydantic's strict (Rust) item check untouched; a list of
    numpy numbers (or an array), which only a Python producer can pass, is converted first."""
    def before(v: Any) -> Any:
        try:
            if hasattr(v, "tolist") and not isinstance(v, list):
                return v.tolist()
            if isinstance(v, list) and v and not isinstance(v[0], _WIRE_TYPES):
                return [convert(x) for x in v]
        except (TypeError, ValueError, OverflowError):
            pass  # not numbers after all: the strict check names the item
        return v
    return before


class _FreeformError(ValueError):
    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.path = path


def _check_plain(v: Any, depth: int) -> None:
    t = type(v)
    if v is None or t is bool or t is str or t is float:
        return
    if t is int:
        if not -(2**63) <= v <= MAX_INT:
            raise _FreeformError("integer outside the signed 64-bit range")
        return
    if t is dict or t is list or t is tuple:
        if depth >= MAX_FREEFORM_DEPTH:
            raise _FreeformError(f"nested deeper than {MAX_FREEFORM_DEPTH} levels")
        items = v.items() if t is dict else enumerate(v)
        for k, x in items:
            if t is dict and type(k) is not str:
                raise _FreeformError(f"map keys must be strings, not {type(k).__name__}")
            try:
                _check_plain(x, depth + 1)
            except _FreeformError as e:
                raise _FreeformError(e.message, (f".{k}" if t is dict else f"[{k}]") + e.path) from None
        return
    raise _FreeformError(f"{t.__name__} values are not accepted (JSON types only; no msgpack extension or bin)")


def plain_json(v: Any) -> Any:
    """``v`` if it is plain JSON within the nesting bound, else ValueError naming where it is not."""
    try:
        _check_plain(v, 0)
    except _FreeformError as e:
        where = e.path.lstrip(".")
        where = where if len(where) <= 80 else where[:77] + "..."
        raise ValueError(f"{where + ': ' if where else ''}{e.message}") from None
    return v


WireInt = Annotated[int, BeforeValidator(_int_only)]
WireFloat = Annotated[float, BeforeValidator(_number_only)]
Freeform = Annotated[Any, BeforeValidator(plain_json)]
FreeformMap = Annotated[dict[StrictStr, Any], BeforeValidator(plain_json)]


class SampleStatus(str, Enum):
    """How a trajectory ended. ``failed`` samples carry no reward and are never trained on."""

    completed = "completed"
    truncated = "truncated"
    aborted = "aborted"
    failed = "failed"


FAILED = SampleStatus.failed.value   # (an enum member's ``.value`` is a Python-level property: hot loops use this)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_enum_values=True)


class Sample(_Wire):
    """One trajectory: prompt + response tokens and what the trainer needs to learn from them."""

    uid: StrictStr = Field(min_length=1, max_length=512, description="unique across the run; the idempotency key")
    group_id: StrictStr = Field(min_length=1, max_length=512, description="samples of one prompt share it")
    index: WireInt = Field(default=0, ge=0, le=MAX_INT, description="position in its group")
    tokens: Annotated[list[StrictInt], BeforeValidator(_python_numbers(operator.index))] = Field(
        description="prompt + response token ids, each in [0, vocab) and [0, 2^31)")
    response_length: WireInt = Field(default=0, ge=0, le=MAX_INT, description="<= len(tokens)")
    loss_mask: Annotated[list[StrictInt], BeforeValidator(_python_numbers(operator.index))] = Field(
        default_factory=list, validate_default=True, description="len == response_length; 0/1 (0 = tool/env tokens)")
    rollout_logprobs: Annotated[list[StrictFloat], BeforeValidator(_python_numbers(float))] | None = Field(
        default=None, description="len == response_length; finite, <= 0")
    reward: WireFloat | None = Field(default=None, description="finite; null only when status is failed")
    status: SampleStatus = Field(default=SampleStatus.completed)
    weight_version: WireInt = Field(default=0, ge=0, le=MAX_INT, description="oldest policy version that produced a response token")
    prompt: StrictStr | None = None
    response: StrictStr | None = None
    label: Freeform = Field(default=None, description="plain JSON, nested at most MAX_FREEFORM_DEPTH levels")
    metadata: FreeformMap = Field(default_factory=dict, description="plain JSON object")

    @field_validator("tokens")
    @classmethod
    def _tokens_in_vocab(cls, v: list[int], info: ValidationInfo) -> list[int]:
        if v and min(v) < 0:
            raise ValueError(f"token ids must be >= 0 (found {min(v)})")
        if v and max(v) > MAX_TOKEN_ID:
            raise ValueError(f"token id {max(v)} is not below 2^31")
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

    group_id: StrictStr = Field(min_length=1, max_length=512)
    samples: list[Sample] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    metadata: FreeformMap = Field(default_factory=dict)

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
    groups: WireInt = Field(ge=1, le=1_000_000, description="exactly this many groups, or 204")
    wait_s: WireFloat = Field(default=0.0, ge=0.0, le=3600.0)
    lease_s: WireFloat = Field(default=600.0, gt=0.0, le=7 * 24 * 3600.0)
    min_weight_version: WireInt | None = Field(default=None, ge=0, le=MAX_INT)


class LeaseResponse(_Wire):
    lease_id: str
    groups: list[Group]
    expires_at: float = Field(description="unix time at which the lease lapses")


class PolicyVersionRequest(_Wire):
    version: WireInt = Field(ge=0, le=MAX_INT)


class ExtendLeaseRequest(_Wire):
    lease_s: WireFloat = Field(gt=0.0, le=7 * 24 * 3600.0, description="new deadline = now + lease_s")
    trained: StrictBool = Field(default=False, description="the lease's step is trained, not yet checkpointed: held")


MAX_REASON = 2000


class RejectLeaseRequest(_Wire):
    group_ids: list[Annotated[StrictStr, Field(min_length=1, max_length=512)]] = Field(
        min_length=1, max_length=1_000_000, description="groups of this lease to dead-letter")
    reason: StrictStr = Field(min_length=1, max_length=MAX_REASON, description="why the trainer cannot use them")


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
