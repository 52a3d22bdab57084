"""The trainer's tensor-parallel model: build a ``TPDecoder`` from a Hugging Face directory.

Public API (the RL code and tools build on these names):

- ``load_model(model_dir, info, dtype)``: each TP rank reads only its shards from safetensors.
- ``TPDecoder``: ``forward`` (local logits shard), ``token_logprobs`` (vocab-parallel logprobs and
  entropy, differentiable), ``hf_state_dict`` (TP-gathered HF tensors on TP rank 0).
- ``vocab_parallel_logprobs``: the logprob/entropy function on its own.

Names are resolved lazily, so torch-free helpers (``trainer.model.support``) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from headrace.trainer.model.decoder import TPDecoder
    from headrace.trainer.model.logprobs import vocab_parallel_logprobs
    from headrace.trainer.parallel import ParallelInfo

__all__ = ["load_model", "TPDecoder", "vocab_parallel_logprobs"]


def load_model(model_dir: "str | Path", info: "ParallelInfo", dtype: "torch.dtype | None" = None) -> "TPDecoder":
    """Build the decoder of ``model_dir`` (config.json + safetensors) sharded for ``info``.

    ``dtype`` defaults to float32. At TP 1 the parameters live in one flat buffer in export order
    (``loading.lay_out_flat``: weight sync sends them without a pack copy). Raises
    FileNotFoundError / ValueError / KeyError naming the missing file, the unsupported setting or
    the missing / misshapen tensor.
    """
    import torch

    from headrace.shared.hf_arch import ArchConfig
    from headrace.trainer.model.decoder import TPDecoder
    from headrace.trainer.model.loading import lay_out_flat, load_shards

    arch = ArchConfig.from_model_dir(model_dir)
    model = TPDecoder(arch, info, dtype or torch.float32)
    load_shards(model, model_dir)
    mark_tp_params(model)
    model = model.to(info.device)
    if info.tp == 1:   # only at TP 1 are the exported tensors views of the parameters
        lay_out_flat(model)
    return model


def mark_tp_params(model: "TPDecoder") -> None:
    """Set megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes on the sharded
    parameters (megatron sets them only when it initialises weights itself), so megatron utilities
    such as ``param_is_not_tensor_parallel_duplicate`` count replicated parameters once."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from headrace.trainer.model.loading import param_specs

    params = dict(model.named_parameters())
    for name, spec in param_specs(model).items():
        p = params[name]
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                delattr(p, attr)
        if spec.mode == "rep":
            p.tensor_model_parallel = False
        else:
            set_tensor_model_parallel_attributes(p, True, 0 if spec.mode == "rows" else 1, 1)


def __getattr__(name: str) -> Any:
    if name == "TPDecoder":
        from headrace.trainer.model.decoder import TPDecoder

        return TPDecoder
    if name == "vocab_parallel_logprobs":
        from headrace.trainer.model.logprobs import vocab_parallel_logprobs

        return vocab_parallel_logprobs
    raise AttributeError(f"module 'headrace.trainer.model' has no attribute {name!r}")
