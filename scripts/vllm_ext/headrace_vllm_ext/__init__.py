"""Headrace's vLLM plugin: weight sync from Headrace's trainer into vLLM 0.32 through vLLM's own
weight-transfer routes, over Headrace's torch.distributed update group (gloo on CPU, NCCL on GPU).

Installed into the vLLM venv only (``scripts/build_vllm_venv.sh``); it imports nothing from
Headrace. vLLM loads ``register`` in every process through the ``vllm.general_plugins`` entry
point; it registers the weight-transfer engine ``headrace`` (``transfer.HeadraceWeightTransferEngine``,
imported lazily by vLLM's factory when a worker creates it), which a server selects with
``--weight-transfer-config '{"backend": "headrace"}'``. Registering twice is a no-op (vLLM may
load plugins more than once per process).
"""

from __future__ import annotations

BACKEND = "headrace"


def register() -> None:
    """Register the ``headrace`` weight-transfer engine with vLLM's factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "headrace_vllm_ext.transfer",
                                                    "HeadraceWeightTransferEngine")
