"""Write a LoRA policy as a PEFT adapter directory and as a merged Hugging Face model.

``save_peft_adapter(model_or_tensors, out_dir, *, base_model_path, lora_cfg)`` writes
``adapter_config.json`` (``peft_type: LORA``, ``task_type: CAUSAL_LM``, ``r``, ``lora_alpha``,
``lora_dropout``, ``target_modules`` as a list, ``base_model_name_or_path``) and
``adapter_model.safetensors`` with PEFT's tensor names, so ``peft.PeftModel.from_pretrained(base,
out_dir)`` gives the trainer's logits (tested with the real ``peft``). Given a LoRA ``TPDecoder`` it
is a collective over the model's TP group (gathered to TP rank 0, which writes; the other ranks
return the path without writing); given a mapping of PEFT-named tensors it just writes them. The
directory is written under a temporary name and renamed: a reader never sees half an adapter.

``save_merged_hf(model, out_dir, source_dir)`` writes ``<out_dir>`` as a full HF model whose
targeted weights are ``W + alpha / rank * B A`` in the base checkpoint's dtype; every other tensor
is bit-identical to the base (it is the frozen base, written back in its own dtype).

``base_checksum(model_dir)``: sha256 over the base checkpoint's weight files (names and bytes),
recorded in LoRA checkpoints so a resume on another base is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from headrace.shared.config_sections import LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_config(lora_cfg: LoRAConfig | Mapping[str, Any], base_model_path: str | Path) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT reads for ``lora_cfg`` (a ``LoRAConfig`` or its dict)."""
    cfg = lora_cfg if isinstance(lora_cfg, LoRAConfig) else LoRAConfig.model_validate(dict(lora_cfg))
    alpha = cfg.rank * cfg.scaling
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
            "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "lora_dropout": cfg.dropout, "target_modules": list(cfg.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "base_model_name_or_path": str(base_model_path)}


def save_peft_adapter(model_or_tensors: nn.Module | Mapping[str, torch.Tensor], out_dir: str | Path, *,
                      base_model_path: str | Path, lora_cfg: LoRAConfig | Mapping[str, Any],
                      dtype: torch.dtype | None = None, durable: bool = True,
                      recycle: str | Path | None = None) -> Path:
    """Write a PEFT LoRA directory at ``out_dir`` (replacing one there) and return its path.

    ``model_or_tensors``: a ``TPDecoder`` with adapters (``trainer.lora.apply_lora``; a collective
    over its TP group, TP rank 0 writes) or ``{PEFT name: full tensor}``. Tensors are written in
    ``dtype`` (default: as they are, the trainer's dtype). ``durable`` fsyncs the files before the
    rename (an export); a weight-sync directory skips it (a crash re-syncs: ~40% of the write's time).
    ``recycle``: a directory of an earlier adapter that no reader needs any more (a weight sync passes
    the version before the previous one): it is renamed to the temporary name and its weights file
    overwritten in place, so the write reuses the page-cache pages it already holds. A new file's
    pages cost a first-touch fault each: 19.6 MB took ~45 ms written anew against ~4 ms in place.
    Raises ValueError for a model without adapters or an empty mapping.
    """
    out = Path(out_dir)
    if isinstance(model_or_tensors, nn.Module):
        tensors = _model_adapters(model_or_tensors, dtype)
        if tensors is None:
            return out
    else:
        tensors = dict(model_or_tensors)
    if not tensors:
        raise ValueError("no adapter tensors to save")
    if _views is None or tensors is not _views[2]:        # the cached views are ready as they are
        tensors = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in tensors.items()}
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    old_dir = Path(recycle) if recycle is not None else None
    if old_dir is not None and old_dir != out and not old_dir.is_symlink() and (old_dir / ADAPTER_WEIGHTS).is_file():
        os.replace(old_dir, tmp)
    else:
        tmp.mkdir(parents=True)
    _write(tmp / ADAPTER_CONFIG, [json.dumps(adapter_config(lora_cfg, base_model_path), indent=1).encode()], durable)
    _write(tmp / ADAPTER_WEIGHTS, _safetensors_parts(tensors, {"format": "pt"}), durable, in_place=True)
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


_views: tuple[Any, list[tuple[torch.Tensor, int]], dict[str, torch.Tensor]] | None = None


def _model_adapters(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
    """The model's adapter tensors by PEFT name (None on TP ranks other than 0). At TP 1 with
    nothing to convert they are views of the parameters (valid until the next step changes them,
    and written before that); those views are built once per model and reused while every
    parameter keeps its storage: walking ~400 modules cost ~12 ms of the ~17 ms a sync's write took."""
    global _views
    from headrace.trainer.lora import adapter_tensors, lora_state

    info = model.info
    if info.tp == 1 and dtype is None and _views is not None and _views[0] is model \
            and all(p.data_ptr() == ptr for p, ptr in _views[1]):
        return _views[2]
    tensors = dict(adapter_tensors(model, copy=False))
    if info.tp_rank != 0:
        return None
    if info.tp == 1 and dtype is None:
        params = [(p, p.data_ptr()) for _, _, mod in lora_state(model).modules
                  for p in (*mod.lora_A.values(), *mod.lora_B.values())]
        _views = (model, params, {k: v.detach().cpu().contiguous() for k, v in tensors.items()})
        return _views[2]
    return tensors


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> list[Any]:
    """The byte pieces of a safetensors file holding ``tensors`` (contiguous CPU float tensors), as
    the format defines it: an 8-byte little-endian header length, the JSON header (``__metadata__``,
    then per tensor ``dtype``, ``shape``, ``data_offsets`` into the data), padded with spaces to 8
    bytes, then every tensor's bytes back to back (wider dtypes first, by name: each stays aligned).
    The tensors' own memory is handed to the write: no serialised copy of the file is built, which
    was most of ``safetensors.torch.save_file``'s time for ~400 small tensors."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this host is not")
    global _last_parts
    if _last_parts[0] is tensors and _last_parts[1] == metadata:   # the cached views of one model
        return _last_parts[2]
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    layout = tuple((n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names)
    data = []
    for name in names:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not a floating point type safetensors names here")
        data.append(t.numpy() if t.dtype != torch.bfloat16 and t.dim() else t.reshape(-1).view(torch.uint8).numpy())
    global _last_header
    if _last_header[0] != (layout, metadata):    # a sync writes the same layout every version: built once
        header: dict[str, Any] = {"__metadata__": metadata}
        at = 0
        for (name, dtype, shape), raw in zip(layout, data):
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + raw.nbytes]}
            at += raw.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        _last_header = ((layout, dict(metadata)), head + b" " * (-len(head) % 8))
    head = _last_header[1]
    parts = [len(head).to_bytes(8, "little"), head, *data]
    if _views is not None and tensors is _views[2]:
        _last_parts = (tensors, dict(metadata), parts)
    return parts


_last_header: tuple[Any, bytes] = (None, b"")
_last_parts: tuple[Any, dict[str, str], list[Any]] = (None, {}, [])


def _write(path: Path, parts: list[Any], durable: bool, in_place: bool = False) -> None:
    """Write ``parts`` (bytes-like) as the file ``path`` with as few ``writev`` calls as the kernel
    takes; fsync'ed when ``durable``. ``in_place``: an existing file is overwritten without being
    truncated first (its cached pages are reused) and cut to the new length after."""
    views = [m for m in (memoryview(p).cast("B") for p in parts) if len(m)]
    total = sum(len(m) for m in views)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if in_place else os.O_TRUNC), 0o644)
    try:
        i = 0
        while i < len(views):
            n = os.writev(fd, views[i:i + 1024])     # IOV_MAX
            while n and i < len(views):              # drop what was written; a partial piece goes on
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i], n = views[i][n:], 0
        if in_place and os.fstat(fd).st_size != total:
            os.ftruncate(fd, total)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def save_merged_hf(model: nn.Module, out_dir: str | Path, source_dir: str | Path) -> Path:
    """The merged policy as a HF directory (see the module docstring); a collective over all ranks."""
    from headrace.trainer.hf_io import save_hf
    from headrace.trainer.lora import merged_tensors

    save_hf(model, out_dir, source_dir, named=lambda: merged_tensors(model, everything=True))
    return Path(out_dir)


@lru_cache(maxsize=8)
def base_checksum(model_dir: str) -> str:
    """sha256 over the weight files of ``model_dir`` (each file's name, then its bytes, in name order)."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors or .bin weight file")
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def save_lora_exports(model: nn.Module, out_dir: str | Path, source_dir: str | Path) -> Path:
    """``headrace run``'s final export with LoRA: the merged model at ``out_dir`` and the PEFT adapter
    at ``<out_dir>-lora`` (``<out>/hf`` and ``<out>/hf-lora``). A collective over all ranks."""
    import torch.distributed as dist

    from headrace.trainer.lora import lora_state

    out = Path(out_dir)
    save_merged_hf(model, out, source_dir)
    info, state = model.info, lora_state(model)
    if info.dp_rank == 0:
        save_peft_adapter(model, out.with_name(out.name + "-lora"), base_model_path=state.base_path,
                          lora_cfg=state.cfg)
    if dist.is_initialized() and info.world_size > 1:
        dist.barrier()
    return out


def lora_meta(model: nn.Module) -> dict[str, Any]:
    """What a LoRA checkpoint records about its adapters and their base (meta.json ``lora``)."""
    from headrace.trainer.lora import lora_state

    state = lora_state(model)
    cfg = state.cfg
    return {"base_model": state.base_path, "base_sha256": base_checksum(state.base_path), "rank": cfg.rank,
            "alpha": cfg.rank * cfg.scaling, "dropout": cfg.dropout, "target_modules": list(cfg.target_modules)}


def check_lora_meta(model: nn.Module, saved: Mapping[str, Any] | None, path: Path, info: Any) -> None:
    """Refuse (ValueError, on every rank) to resume ``model`` from a checkpoint whose LoRA record
    ``saved`` (None: full fine-tuning) does not fit: LoRA vs full, another rank / alpha / targets, or
    another base model (by checksum; computed on rank 0 and its verdict broadcast)."""
    import torch.distributed as dist

    from headrace.trainer.lora import lora_state

    state = lora_state(model)
    problem = ""
    if state is None and saved is not None:
        problem = (f"checkpoint {path} holds LoRA adapters (rank {saved.get('rank')}) but trainer.lora is null: "
                   "set the same trainer.lora to resume it")
    elif state is not None and saved is None:
        problem = f"checkpoint {path} is a full fine-tuning checkpoint but trainer.lora is set: drop trainer.lora"
    elif state is not None:
        cfg = state.cfg
        ours = {"rank": cfg.rank, "alpha": cfg.rank * cfg.scaling, "target_modules": list(cfg.target_modules)}
        diff = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
        if diff:
            problem = "; ".join(f"trainer.lora.{k} is {v!r} but checkpoint {path} has {s!r}" for k, (s, v) in diff.items())
        elif info.rank == 0 and saved.get("base_sha256") != base_checksum(state.base_path):
            problem = (f"checkpoint {path} was trained on base model {saved.get('base_model')} (sha256 "
                       f"{str(saved.get('base_sha256'))[:12]}...) but this run's base {state.base_path} has sha256 "
                       f"{base_checksum(state.base_path)[:12]}...: resume on the same base model")
    if dist.is_initialized() and info.world_size > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = problem or box[0]
    if problem:
        raise ValueError(problem)
