"""Weight sync: trainer rank 0 pushes full Hugging Face-named tensors to every engine over one
torch.distributed group, through SGLang's weight-update HTTP API (see DESIGN.md "Weight sync").

Modules: ``protocol`` (the wire contract both sides use: request bodies as pydantic models,
EngineTarget, WeightSyncError; no torch), ``group`` (join / destroy the update group, the one
piece of torch.distributed both sides share), ``buckets`` (bucket planning and flat packing),
``fanout`` (concurrent HTTP to every engine; no torch), ``sender`` (WeightSender). The engine's
receiver is ``rollout.engine.session``.

Importing this package does not import torch: the torch-backed names below load on first use,
so ``from headrace.shared.weight_sync import EngineTarget`` stays light (the rollout client).
"""

from __future__ import annotations

import importlib
from typing import Any

from headrace.shared.procs import free_port
from headrace.shared.weight_sync.fanout import engines_from_rollout
from headrace.shared.weight_sync.protocol import (DEFAULT_GROUP, FLATTENED, DestroyGroupRequest, EngineTarget,
                                                  InitGroupRequest, UpdateBucketRequest, WeightSyncError)

_LAZY = {"WeightSender": "sender", "join_update_group": "group", "destroy_update_group": "group",
         "plan_buckets": "buckets", "flatten_bucket": "buckets", "unflatten_bucket": "buckets",
         "dtype_name": "buckets", "parse_dtype": "buckets", "contiguous_run": "buckets"}

__all__ = ["WeightSyncError", "EngineTarget", "FLATTENED", "DEFAULT_GROUP", "InitGroupRequest",
           "UpdateBucketRequest", "DestroyGroupRequest", "engines_from_rollout", "free_port", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
