"""The adapter weight sync (``trainer.lora_sync: adapter``): what trainer and rollout service agree on.

- The trainer writes policy version v's adapter as a PEFT directory ``adapter_dir(cfg, v)`` =
  ``<run.out>/lora-sync/v<v>``, on a file system the engines read (the same machine, or a mount
  shared by trainer and engines at the same path).
- It posts ``LoadAdapterRequest`` ``{"path", "weight_version"}`` to the rollout service's
  ``POST /v1/load_adapter``: every engine loads the directory as ``adapter_name(v)`` = ``"v<v>"``
  (SGLang's ``/load_lora_adapter``) and takes v as its weight version; then ``/v1/resume
  {"weight_version": v}`` makes generation name that adapter, and the previous one is unloaded.
- Reference engines launched by the fleet may read ``adapter_root(cfg)`` (``--allowed-weight-dirs``).
No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoadAdapterRequest", "adapter_name", "adapter_root", "adapter_dir", "adapter_mode"]

SUBDIR = "lora-sync"
MAX_VERSION = 2**63 - 1


class LoadAdapterRequest(BaseModel):
    """Body of the rollout service's ``POST /v1/load_adapter``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1, max_length=4096, description="the PEFT directory, as the engines see it")
    weight_version: int = Field(ge=0, le=MAX_VERSION, description="the policy version it holds; named v<version>")


def adapter_name(version: int) -> str:
    """The name every engine serves version ``version``'s adapter under."""
    return f"v{version}"


def adapter_root(cfg: Any) -> Path:
    """The directory the per-version adapter directories live in."""
    return Path(cfg.run.out).resolve() / SUBDIR


def adapter_dir(cfg: Any, version: int) -> Path:
    return adapter_root(cfg) / adapter_name(version)


def adapter_mode(cfg: Any) -> bool:
    """Whether this run syncs weights as adapters (``trainer.lora`` set, ``trainer.lora_sync: adapter``)."""
    t = cfg.trainer
    return getattr(t, "lora", None) is not None and getattr(t, "lora_sync", "merged") == "adapter"
