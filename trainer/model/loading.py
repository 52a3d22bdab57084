"""Mapping between the TP decoder's sharded parameters and Hugging Face tensors, both directions.

Every parameter of ``TPDecoder`` has a ``Spec``: the HF tensors it is made of and how they are split
over TP ranks:

- ``rep``: replicated (norms, row-parallel biases); every rank holds the full tensor.
- ``rows``: split along dim 0 into TP equal slices (column-parallel weights and biases, the
  vocabulary); several HF tensors (q/k/v, gate/up) are fused by concatenating each one's slice
  for this rank, in order.
- ``cols``: split along dim 1 (row-parallel weights: o_proj, down_proj).

A split dimension that TP does not divide is padded at its tail with zeros (heads, MLP width,
vocabulary; see ``support.padded_dims``); export drops the padding.

Loading reads only this rank's slices (``safe_open(...).get_slice``), so no rank ever holds the
full checkpoint. Export gathers the slices to TP rank 0 and undoes the fusing and padding, which
makes load -> export bit-identical for tensors in the model's dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from headrace.trainer.model.support import padded_dims

# ``model`` below is a ``decoder.TPDecoder`` (arch, info, tied, layers): typed as nn.Module because
# decoder imports this module (``TPDecoder.hf_state_dict``) and nothing may import it back.


@dataclass(frozen=True)
class Spec:
    parts: tuple[tuple[str, int], ...]  # (HF name, padded length along the split dim); fused in order
    mode: str                           # rep | rows | cols


def param_specs(model: nn.Module) -> dict[str, Spec]:
    """Spec of every parameter of ``model`` (our name -> Spec)."""
    a = model.arch
    dims = padded_dims(a, model.info.tp)
    hd = a.head_dim
    heads = {"q": dims["heads"] * hd, "k": dims["kv_heads"] * hd, "v": dims["kv_heads"] * hd}
    inter = dims["intermediate"]

    def rep(name: str) -> Spec:
        return Spec(((name, 0),), "rep")

    specs: dict[str, Spec] = {"embed.weight": Spec((("model.embed_tokens.weight", dims["vocab"]),), "rows"),
                              "norm.weight": rep("model.norm.weight")}
    if not model.tied:
        specs["lm_head.weight"] = Spec((("lm_head.weight", dims["vocab"]),), "rows")
    for i, layer in enumerate(model.layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        att, mlp = hf + "self_attn.", hf + "mlp."
        specs[ours + "input_norm.weight"] = rep(hf + "input_layernorm.weight")
        specs[ours + "post_norm.weight"] = rep(hf + "post_attention_layernorm.weight")
        specs[ours + "attn.qkv.weight"] = Spec(tuple((att + f"{x}_proj.weight", n) for x, n in heads.items()), "rows")
        if layer.attn.qkv.bias is not None:
            specs[ours + "attn.qkv.bias"] = Spec(tuple((att + f"{x}_proj.bias", n) for x, n in heads.items()), "rows")
        specs[ours + "attn.o.weight"] = Spec(((att + "o_proj.weight", heads["q"]),), "cols")
        if layer.attn.o.bias is not None:
            specs[ours + "attn.o.bias"] = rep(att + "o_proj.bias")
        if layer.attn.q_norm is not None:
            specs[ours + "attn.q_norm.weight"] = rep(att + "q_norm.weight")
            specs[ours + "attn.k_norm.weight"] = rep(att + "k_norm.weight")
        specs[ours + "mlp.gate_up.weight"] = Spec(((mlp + "gate_proj.weight", inter), (mlp + "up_proj.weight", inter)), "rows")
        if layer.mlp.gate_up.bias is not None:
            specs[ours + "mlp.gate_up.bias"] = Spec(((mlp + "gate_proj.bias", inter), (mlp + "up_proj.bias", inter)), "rows")
        specs[ours + "mlp.down.weight"] = Spec(((mlp + "down_proj.weight", inter),), "cols")
        if layer.mlp.down.bias is not None:
            specs[ours + "mlp.down.bias"] = rep(mlp + "down_proj.bias")
    names = {n for n, _ in model.named_parameters() if ".lora." not in n}   # LoRA adapters: trainer.lora
    assert names == set(specs), f"parameters without a spec: {names ^ set(specs)}"
    return specs


def lay_out_flat(model: nn.Module) -> None:
    """Move the parameters ``param_specs`` names into one flat buffer per dtype and device, in
    ``param_specs`` order (the order ``gather_hf_tensors`` exports). Values and ``Parameter``
    objects are unchanged, only their storage moves. At TP 1 the exported tensors are then views
    lying back to back, so weight sync broadcasts whole buckets straight from the parameters, with
    no pack copy (``shared.weight_sync.buckets.contiguous_run``). Peak memory while it runs: twice
    the parameters'."""
    params = dict(model.named_parameters())
    groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for name in param_specs(model):
        p = params[name]
        groups.setdefault((p.dtype, p.device), []).append(p)
    with torch.no_grad():
        for (dtype, device), ps in groups.items():
            flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=device)
            offset = 0
            for p in ps:
                view = flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()


def full_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The HF shape each HF tensor must have for ``model.arch``."""
    a = model.arch
    h, hd, inter = a.hidden_size, a.head_dim, a.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (a.vocab_size, h)}
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        rows = {"q": a.num_heads * hd, "k": a.num_kv_heads * hd, "v": a.num_kv_heads * hd}
        for x, n in rows.items():
            shapes[p + f"self_attn.{x}_proj.weight"] = (n, h)
            shapes[p + f"self_attn.{x}_proj.bias"] = (n,)
        shapes.update({p + "self_attn.o_proj.weight": (h, a.num_heads * hd), p + "self_attn.o_proj.bias": (h,),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "mlp.gate_proj.bias": (inter,),
                       p + "mlp.up_proj.bias": (inter,), p + "mlp.down_proj.bias": (h,)})
    return shapes


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: d / fname for name, fname in weight_map.items()}
    single = d / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{d} has neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


class _Reader:
    """Open safetensors files lazily, once each; read slices of named tensors."""

    def __init__(self, model_dir: str | Path) -> None:
        self.index = checkpoint_index(model_dir)
        self.dir = Path(model_dir)
        self._open: dict[Path, Any] = {}

    def slice(self, name: str, shape: tuple[int, ...]) -> Any:
        from safetensors import safe_open

        if name not in self.index:
            raise KeyError(f"tensor {name} is missing from the checkpoint in {self.dir}")
        path = self.index[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        sl = self._open[path].get_slice(name)
        got = tuple(sl.get_shape())
        if got != shape:
            raise ValueError(f"tensor {name} in {path.name} has shape {got}, expected {shape} from config.json")
        return sl


@torch.no_grad()
def load_shards(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` with this rank's slice of the checkpoint (zero padding)."""
    reader, shapes = _Reader(model_dir), full_shapes(model)
    tp, r = model.info.tp, model.info.tp_rank
    params = dict(model.named_parameters())
    for ours, spec in param_specs(model).items():
        param = params[ours]
        pieces = []
        for name, padded in spec.parts:
            sl = reader.slice(name, shapes[name])
            if spec.mode == "rep":
                pieces.append(sl[:])
                continue
            dim = 0 if spec.mode == "rows" else 1
            real, n = shapes[name][dim], padded // tp
            lo, hi = min(r * n, real), min((r + 1) * n, real)
            shape = list(shapes[name])
            shape[dim] = n
            piece = torch.zeros(shape, dtype=param.dtype)
            if hi > lo:
                if dim == 0:
                    piece[: hi - lo] = sl[lo:hi].to(param.dtype)
                else:
                    piece[:, : hi - lo] = sl[:, lo:hi].to(param.dtype)
            pieces.append(piece)
        local = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(f"{[p for p, _ in spec.parts]} gave a local shard of shape {tuple(local.shape)} "
                             f"for {ours}, expected {tuple(param.shape)}")
        param.copy_(local.to(param.dtype))


@torch.no_grad()
def gather_hf_tensors(model: nn.Module, only: set[str] | None = None,
                      copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs, layer by layer, on the model's device (NCCL weight sync sends
    them from there); yields on TP rank 0 only. A collective over the TP group. ``only``: the
    parameters (our names) to gather, default all. ``copy=False``: where nothing is gathered (TP 1,
    replicated tensors) a tensor may be a read-only view of the live parameter, valid until the
    next optimizer step (weight sync packs or sends it before that); by default every tensor is
    the caller's own."""
    info, shapes = model.info, full_shapes(model)
    tp, leader = info.tp, info.tp_rank == 0
    params = dict(model.named_parameters())
    for ours, spec in param_specs(model).items():
        if only is not None and ours not in only:
            continue
        local = params[ours].detach().contiguous()
        if spec.mode == "rep" or tp == 1:
            shards = [local]
        else:
            shards = [torch.empty_like(local) for _ in range(tp)] if leader else None
            dist.gather(local, shards, group=info.tp_group, group_dst=0)
        if not leader:
            continue
        if spec.mode == "rep":
            yield spec.parts[0][0], local.clone() if copy else local   # by default never the live parameter
            continue
        dim = 0 if spec.mode == "rows" else 1
        per_rank = [s.split([padded // tp for _, padded in spec.parts], dim=dim) for s in shards]
        for j, (name, _) in enumerate(spec.parts):
            pieces = [p[j] for p in per_rank]
            full = pieces[0] if len(pieces) == 1 and not copy else torch.cat(pieces, dim=dim)
            yield name, full.narrow(dim, 0, shapes[name][dim]).contiguous()
