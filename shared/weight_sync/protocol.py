"""The weight-sync wire contract, shared by the sender (trainer rank 0) and the engine's receiver:
the request bodies of SGLang 0.5.23's weight-update endpoints as pydantic models, the engine
address, and the one error type. No torch here: the rollout client imports this module.

The sender builds every body from these models and sends ``wire(model)`` (the fields it set, so
the JSON is exactly what SGLang expects); the reference engine validates every body with the same
model (``parse``): integers are JSON integers (not "7", true or 3.0), strings are strings, a
``null`` field takes its default, unknown fields are ignored (SGLang adds fields across versions).

Endpoint -> body:
- ``/init_weights_update_group``: InitGroupRequest (rank 0 is the trainer, so 1 <= rank_offset < world_size)
- ``/begin_weight_update``, ``/end_weight_update``: ``{}``
- ``/update_weights_from_distributed``: UpdateBucketRequest (one bucket; names/dtypes/shapes of
  equal length, in broadcast order; only the last bucket of an update carries ``weight_version``)
- ``/destroy_weights_update_group``: DestroyGroupRequest
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Sequence, Type, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["WeightSyncError", "EngineTarget", "FLATTENED", "DEFAULT_GROUP", "InitGroupRequest",
           "UpdateBucketRequest", "DestroyGroupRequest", "parse", "wire"]

FLATTENED = "flattened_bucket"
DEFAULT_GROUP = "weight_update_group"   # SGLang's default group_name


class WeightSyncError(RuntimeError):
    """A weight-sync step failed. ``urls`` are the engines that failed (empty: the local side)."""

    def __init__(self, message: str, urls: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.urls = list(urls)


@dataclass
class EngineTarget:
    """One engine: its base URL and how many ranks it has in the group (its TP size)."""

    url: str
    world_size: int = 1

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://: {self.url!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"engine {self.url}: world_size must be an int >= 1, got {self.world_size!r}")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class InitGroupRequest(_Body):
    master_address: str = Field(min_length=1, description="host of rank 0's rendezvous store")
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="this engine's TP rank 0 joins as rank_offset (rank 0 is the trainer)")
    world_size: int = Field(ge=2, description="trainer rank 0 + every engine rank")
    group_name: str = Field(DEFAULT_GROUP, min_length=1)
    backend: Literal["gloo", "nccl"] = "nccl"

    @model_validator(mode="after")
    def _offset_in_group(self) -> "InitGroupRequest":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be in [1, world_size={self.world_size})")
        return self


Shape = list[Annotated[int, Field(ge=0)]]


class UpdateBucketRequest(_Body):
    names: list[str] = Field(min_length=1, description="HF names, in broadcast order")
    dtypes: list[str] = Field(min_length=1, description="torch dtype names (bfloat16), len == len(names)")
    shapes: list[Shape] = Field(min_length=1, description="len == len(names)")
    group_name: str = Field(DEFAULT_GROUP, min_length=1)
    weight_version: Optional[str] = Field(None, description="set on the last bucket only: the version the engine "
                                                             "reports once every bucket loaded")
    load_format: Optional[Literal["flattened_bucket", "auto"]] = Field(
        None, description="flattened_bucket: one flat broadcast of one dtype; None: one broadcast per tensor")
    flush_cache: bool = True
    abort_all_requests: bool = False

    @model_validator(mode="after")
    def _same_lengths(self) -> "UpdateBucketRequest":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length "
                             f"({len(self.names)}, {len(self.dtypes)}, {len(self.shapes)})")
        if self.load_format == FLATTENED and len(set(self.dtypes)) != 1:
            raise ValueError(f"a flattened bucket holds one dtype, got {sorted(set(self.dtypes))}")
        return self


class DestroyGroupRequest(_Body):
    group_name: str = Field(DEFAULT_GROUP, min_length=1)


M = TypeVar("M", bound=_Body)


def parse(model: Type[M], body: Any) -> M:
    """Validate a request body; ValueError names the bad field. ``null`` fields take their default."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise ValueError(problems) from None


def wire(request: _Body) -> dict[str, Any]:
    """The JSON body to send: the fields the sender set (defaults are left to the engine)."""
    return request.model_dump(exclude_unset=True)
