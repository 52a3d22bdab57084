"""Checkpoint and resume of a TP x DP trainer, and HF export of the current policy.

Layout under ``checkpoint_dir``::

    step_00000012/
        meta.json          step, policy_version, data positions (groups/samples consumed), tp, dp
        model_tp0.pt       this TP shard's model state_dict, optimizer and scheduler state
        rng_rank0.pt       torch / python / numpy RNG states of global rank 0 (one per rank)
    latest                 the name of the newest complete checkpoint

Guarantees:
- A checkpoint is complete or absent, and durable once written: ranks write into ``step_N.tmp``
  and fsync their files; after a barrier rank 0 fsyncs ``meta.json`` and the directory, renames it
  to ``step_N``, then rewrites ``latest`` atomically (write + fsync + rename) and fsyncs the parent
  directory. A crash (or power loss) while saving leaves the previous checkpoint as ``latest``;
  once ``save`` returns a path, that checkpoint survives one. The trainer acks the groups of the
  steps it contains only then (``trainer.lease``).
- Model and optimizer shards are written once per TP rank (by DP rank 0; DP replicas are equal).
  With LoRA (``trainer.lora``) the model shard holds the adapters only and meta.json names the base
  model, its checksum and the adapter shape; a resume on another base, rank, alpha or targets is
  refused with an error naming both (``trainer.lora_export.check_lora_meta``).
- ``load_checkpoint`` restores model, optimizer, scheduler, step, policy version, data positions and
  every RNG, so the next step computes the same loss, bit for bit, as an uninterrupted run on the
  same batch. Resuming with a different TP or DP size is refused with a clear error.
- Every function here, and ``Checkpointer.save`` / ``resume``, is a collective over all ranks
  (call it on every rank).
- ``Checkpointer`` owns the save cadence (torchtitan's pattern): the loop calls ``save(step)``
  after every step and ``save(step, last=True)`` when it stops for any reason; the checkpointer
  writes every ``every`` steps and at the last step, never the same step twice, and never a step
  it started from (nothing was trained since). The loop keeps no bookkeeping of its own.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from headrace.trainer.lora import lora_state
from headrace.trainer.lora_export import check_lora_meta, lora_meta
from headrace.trainer.step import TrainerState

log = logging.getLogger("headrace.trainer")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    # numpy's key array travels as a tensor so the file loads with torch.load(weights_only=True)
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                           "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _load(file: Path) -> Any:
    """``torch.load`` restricted to tensors and plain containers (``weights_only=True``): a
    checkpoint file cannot run code when it is read."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{file} holds objects other than tensors and plain values (written by an older "
                         f"Headrace?); refusing to unpickle it: {e}") from None


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's contents (a directory: its entries, e.g. a rename) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of the model: everything, or with LoRA the adapters only (the frozen
    base is the model directory, named and checksummed in meta.json)."""
    sd = model.state_dict()
    return {k: v for k, v in sd.items() if ".lora." in k} if lora_state(model) is not None else sd


def _load_model_state(model: torch.nn.Module, sd: dict[str, Any], path: Path) -> None:
    if lora_state(model) is None:
        model.load_state_dict(sd)
        return
    res = model.load_state_dict(sd, strict=False)
    missing = [k for k in res.missing_keys if ".lora." in k]
    if missing or res.unexpected_keys:
        raise ValueError(f"checkpoint {path} does not hold this model's adapters (missing {missing[:3]}, "
                         f"unexpected {list(res.unexpected_keys)[:3]})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(st: TrainerState, checkpoint_dir: str | Path, keep: int = 2) -> Path:
    """Save everything needed to resume; returns the checkpoint directory. Collective."""
    root = Path(checkpoint_dir)
    info = st.info
    final = root / step_dir_name(st.step)
    tmp = root / (final.name + ".tmp")
    if info.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    if info.dp_rank == 0:
        torch.save({"model": _model_state(st.model), "optimizer": st.optimizer.state_dict(),
                    "scheduler": st.scheduler.state_dict()}, tmp / f"model_tp{info.tp_rank}.pt")
        _fsync(tmp / f"model_tp{info.tp_rank}.pt")
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
    _fsync(tmp / f"rng_rank{info.rank}.pt")
    _barrier()
    if info.rank == 0:
        meta = {"step": st.step, "policy_version": st.policy_version, "groups_consumed": st.groups_consumed,
                "samples_consumed": st.samples_consumed, "tp": info.tp, "dp": info.dp, "extra": st.extra}
        if lora_state(st.model) is not None:
            meta["lora"] = lora_meta(st.model)
        _write_durably(tmp / "meta.json", json.dumps(meta, indent=1))
        _fsync(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        _write_durably(latest_tmp, final.name)
        os.replace(latest_tmp, root / "latest")
        _fsync(root)
        if keep > 0:
            old = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
            for p in old[:-keep]:
                shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoint_dir``, or None."""
    root = Path(checkpoint_dir)
    marker = root / "latest"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def load_checkpoint(st: TrainerState, path: str | Path) -> dict[str, Any]:
    """Restore ``st`` in place from the checkpoint at ``path``; returns its meta. Collective."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    info = st.info
    if (meta["tp"], meta["dp"]) != (info.tp, info.dp):
        raise ValueError(f"checkpoint {path} was written at tp={meta['tp']} dp={meta['dp']}; this trainer runs "
                         f"tp={info.tp} dp={info.dp} (export to HF and start from that to change the layout)")
    check_lora_meta(st.model, meta.get("lora"), path, info)
    blob = _load(path / f"model_tp{info.tp_rank}.pt")
    _load_model_state(st.model, blob["model"], path)
    st.optimizer.load_state_dict(blob["optimizer"])
    st.scheduler.load_state_dict(blob["scheduler"])
    rng_file = path / f"rng_rank{info.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(_load(rng_file))
    st.step = int(meta["step"])
    st.policy_version = int(meta["policy_version"])
    st.groups_consumed = int(meta["groups_consumed"])
    st.samples_consumed = int(meta["samples_consumed"])
    st.extra = dict(meta.get("extra") or {})
    _barrier()
    return meta


class Checkpointer:
    """Saves ``st`` under ``directory`` when the cadence says so; resumes it from the newest save.

    ``every``: write after every ``every``-th step (0: only at the last step). ``keep``: how many
    complete checkpoints stay on disk.
    """

    def __init__(self, st: TrainerState, directory: str | Path, every: int = 0, keep: int = 2) -> None:
        if every < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {every}")
        self.st, self.directory, self.every, self.keep = st, Path(directory), every, keep
        self.saved_step = st.step   # the step whose state is on disk (or was the starting point)

    def resume(self) -> Path | None:
        """Restore ``st`` from the newest complete checkpoint, if any; returns its path. Collective."""
        latest = latest_checkpoint(self.directory)
        if latest is not None:
            load_checkpoint(self.st, latest)
            self.saved_step = self.st.step
            log.info("resumed from %s (step %d, policy version %d)", latest, self.st.step, self.st.policy_version)
        return latest

    def due(self, step: int, last: bool = False) -> bool:
        """Whether ``save(step, last=last)`` writes: a step not yet saved that is the last one or a
        multiple of ``every``."""
        return step != self.saved_step and (last or (self.every > 0 and step % self.every == 0))

    def save(self, step: int, *, last: bool = False) -> Path | None:
        """Call after every step (``last=True`` when training stops); writes when ``due``. Returns the
        checkpoint's path when it wrote one (durable: see the module docstring), else None. Collective."""
        if step != self.st.step:
            raise ValueError(f"save({step}) but the trainer state is at step {self.st.step}")
        if not self.due(step, last):
            return None
        path = save_checkpoint(self.st, self.directory, keep=self.keep)
        self.saved_step = step
        return path


def export_hf(st: TrainerState, out_dir: str | Path, source_dir: str | Path) -> Path:
    """Write the current policy as a Hugging Face directory (config + tokenizer from ``source_dir``);
    with LoRA the merged model, and the PEFT adapter beside it in ``<out_dir>-lora``.

    Collective over all ranks (``trainer.hf_io.save_hf``: DP rank 0's TP group gathers, rank 0 writes).
    """
    from headrace.trainer.hf_io import save_hf

    out = Path(out_dir)
    if lora_state(st.model) is None:
        save_hf(st.model, out, source_dir)
        return out
    from headrace.trainer.lora_export import save_lora_exports

    return save_lora_exports(st.model, out, source_dir)
