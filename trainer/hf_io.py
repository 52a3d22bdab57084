"""Export the trainer's TP-sharded model as a Hugging Face model directory.

``save_hf(model, out_dir, source_dir)`` is a collective over all ranks: the TP group of DP rank 0
gathers the shards (``TPDecoder.hf_state_dict``) and global rank 0 writes ``model.safetensors``
plus every non-weight file of ``source_dir`` (config.json, generation_config.json, tokenizer
files, chat template), so the result loads with ``transformers`` and SGLang like the source.

Guarantees: each tensor is written in the dtype it has in the source checkpoint (unless ``dtype``
is given), with the source's HF names, so loading a checkpoint and saving it again without
training is bit-identical tensor by tensor. The file is written to a temporary name and renamed,
so a crash never leaves a half-written model.safetensors. Every rank returns only after rank 0 has
finished writing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from headrace.trainer.model import TPDecoder

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _source_dtypes(source_dir: Path) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    from headrace.trainer.model.loading import checkpoint_index

    dtypes: dict[str, torch.dtype] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in checkpoint_index(source_dir).items():
        by_file.setdefault(path, []).append(name)
    names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    for path, tensors in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in tensors:
                code = f.get_slice(name).get_dtype()
                if code in names:
                    dtypes[name] = names[code]
    return dtypes


def copy_non_weight_files(source_dir: Path, out_dir: Path) -> None:
    """Copy config, tokenizer and other small files (not weights) from ``source_dir``."""
    for item in source_dir.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name not in _WEIGHT_INDEXES:
            shutil.copy2(item, out_dir / item.name)


def save_hf(model: TPDecoder, out_dir: str | Path, source_dir: str | Path, *,
            dtype: torch.dtype | None = None,
            named: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None) -> None:
    """Write ``model`` as a HF directory at ``out_dir``; a collective over every rank of the job.
    ``named``: what to write instead of ``model.hf_state_dict()`` (a LoRA model's merged tensors)."""
    from safetensors.torch import save_file

    source, out = Path(source_dir), Path(out_dir)
    info = model.info
    writer = info.rank == 0
    # checked on every rank, before any collective, so a bad argument fails everywhere at once
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}/config.json not found: source_dir must be the HF model the policy came from")
    if out.resolve() == source.resolve():
        raise ValueError(f"out_dir {out} is the source directory; export to a new directory")
    tensors: dict[str, torch.Tensor] = {}
    if info.dp_rank == 0:
        src_dtypes = _source_dtypes(source) if writer and dtype is None else {}
        for name, t in (named or model.hf_state_dict)():
            if writer:
                tensors[name] = t.to(dtype or src_dtypes.get(name, t.dtype)).cpu().contiguous()
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        copy_non_weight_files(source, out)
        tmp = out / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / "model.safetensors")
    if dist.is_initialized() and info.world_size > 1:
        dist.barrier()
