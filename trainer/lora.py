"""LoRA adapters on the trainer's tensor-parallel decoder (DESIGN.md "LoRA").

``apply_lora(model, cfg, base_path=...)`` freezes every base parameter and attaches one adapter
per targeted Hugging Face module (q/k/v/o_proj, gate/up/down_proj) to the megatron linear that
holds it, as a forward hook that adds ``scale * dropout(x) A^T B^T`` (scale = alpha / rank) to the
linear's output; the decoder's own code is unchanged. Tensor parallelism is Megatron's:

- column-parallel linears (fused q|k|v, fused gate|up): A [r, in] is replicated, B [out, r] is
  sharded along the output like the base weight. The A-product [T, r] enters B through
  "copy to TP region" (identity forward, gradient summed over TP), so A's gradient is the full one
  on every rank and the input gradient is complete.
- row-parallel linears (o_proj, down_proj): A [r, in] is sharded along the input like the base
  weight, its partial product is all-reduced ("reduce from TP region"), B [out, r] is replicated
  and gets identical gradients on every rank.

So TP=1 and TP=2 compute the same logprobs and gradients up to float reordering (tested). Padded
heads / MLP units (``model.support.padded_dims``) get zero rows of B and zero columns of A: their
outputs and gradients stay exactly 0, so padding stays zero under training and export drops it.

Initialisation is PEFT's: A uniform in +-1/sqrt(in) from a generator seeded by ``seed`` (full
size, then sharded, so every TP layout starts from the same adapter) and B = 0, so step 0 is the
base model. Dropout acts on the adapter input only in training mode (``model.train()``): the
old-logprob, reference and evaluation passes (eval mode) run without it. With TP > 1 every rank
draws its dropout mask from the same seeded torch RNG stream in the same order.

Adapter tensors leave and enter the model under PEFT's names (``adapter_tensors`` /
``load_adapter_tensors``: full, unpadded, gathered to TP rank 0); ``merged_tensors`` yields the
targeted HF weights ``W + scale * B A`` (fp32 arithmetic, the model's dtype) for a merged weight
sync and the merged export. The KL reference is the same model with its adapters off
(``AdaptersOff``), not a second copy.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from headrace.shared.config_sections import LORA_TARGETS, LoRAConfig
from headrace.trainer.model.support import padded_dims

# HF module -> (layer attribute holding the megatron linear, kind, index of its part in a fused output)
_PLACES: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn.qkv", "column", 0), "k_proj": ("attn.qkv", "column", 1), "v_proj": ("attn.qkv", "column", 2),
    "o_proj": ("attn.o", "row", 0),
    "gate_proj": ("mlp.gate_up", "column", 0), "up_proj": ("mlp.gate_up", "column", 1),
    "down_proj": ("mlp.down", "row", 0),
}
_PARTS = {"attn.qkv": ("q_proj", "k_proj", "v_proj"), "attn.o": ("o_proj",),
          "mlp.gate_up": ("gate_proj", "up_proj"), "mlp.down": ("down_proj",)}


def hf_module(layer: int, target: str) -> str:
    """The HF module path of ``target`` in layer ``layer`` (``model.layers.3.self_attn.q_proj``)."""
    return f"model.layers.{layer}.{'mlp' if target in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{target}"


def peft_names(layer: int, target: str) -> tuple[str, str]:
    """PEFT's tensor names of the adapter of ``target`` in ``layer`` (A, B)."""
    base = f"base_model.model.{hf_module(layer, target)}"
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def _sizes(arch: Any, tp: int, target: str) -> tuple[int, int, int, int]:
    """(in_real, out_real, padded length of the TP-split dim, real length of that dim) of ``target``."""
    dims, hd, h = padded_dims(arch, tp), arch.head_dim, arch.hidden_size
    if target == "q_proj":
        return h, arch.num_heads * hd, dims["heads"] * hd, arch.num_heads * hd
    if target in ("k_proj", "v_proj"):
        return h, arch.num_kv_heads * hd, dims["kv_heads"] * hd, arch.num_kv_heads * hd
    if target in ("gate_proj", "up_proj"):
        return h, arch.intermediate_size, dims["intermediate"], arch.intermediate_size
    if target == "o_proj":
        return arch.num_heads * hd, h, dims["heads"] * hd, arch.num_heads * hd
    return arch.intermediate_size, h, dims["intermediate"], arch.intermediate_size     # down_proj


class LoRALinear(nn.Module):
    """The adapters of one megatron linear (one per targeted part of a fused output).

    ``lora_A[t]`` / ``lora_B[t]`` hold this rank's shard (see the module docstring); ``forward(x)``
    is the delta to add to the linear's output ([T, out_local] for column, [T, out] for row).
    """

    def __init__(self, kind: str, parts: list[tuple[str, int]], targets: list[str], rank: int, in_local: int,
                 out_full: int, scale: float, dropout: float, group: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.parts, self.scale, self.group = kind, parts, scale, group
        self.enabled = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for t, n_local in parts:
            if t not in targets:
                continue
            self.lora_A[t] = nn.Parameter(torch.zeros(rank, in_local, dtype=dtype))
            self.lora_B[t] = nn.Parameter(torch.zeros(n_local if kind == "column" else out_full, rank, dtype=dtype))
            # megatron's attributes: what grad-norm and checkpoint code read to tell shards from replicas
            a_split, b_split = (False, True) if kind == "column" else (True, False)
            for p, split, dim in ((self.lora_A[t], a_split, 1), (self.lora_B[t], b_split, 0)):
                p.tensor_model_parallel = split
                if split:
                    p.partition_dim, p.partition_stride = dim, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        xd = self.dropout(x)
        tp = self.group.size() > 1
        if self.kind == "row":
            (t, _), = self.parts
            h = xd @ self.lora_A[t].t()
            if tp:
                h = reduce_from_tensor_model_parallel_region(h, self.group)
            return (h * self.scale) @ self.lora_B[t].t()
        outs = []
        for t, n_local in self.parts:
            if t not in self.lora_A:
                outs.append(x.new_zeros(x.shape[0], n_local))
                continue
            h = xd @ self.lora_A[t].t()
            if tp:
                h = copy_to_tensor_model_parallel_region(h, self.group)
            outs.append((h * self.scale) @ self.lora_B[t].t())
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _add_adapter(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook of a megatron linear: add its adapter's delta to the (output, bias) pair."""
    lora = module.lora
    if not lora.enabled:
        return output
    out, bias = output
    return out + lora(args[0]).to(out.dtype), bias


@dataclass
class LoRAState:
    """What a LoRA model carries besides its parameters (``model.lora_state``)."""

    cfg: LoRAConfig
    base_path: str
    modules: list[tuple[int, str, LoRALinear]]   # (layer, linear attribute, adapters)

    @property
    def scale(self) -> float:
        return self.cfg.scaling


def _linear(layer: nn.Module, attr: str) -> nn.Module:
    obj = layer
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, base_path: str, seed: int = 0) -> LoRAState:
    """Freeze ``model`` (a ``TPDecoder``) and attach the adapters of ``cfg``; returns its ``LoRAState``
    (also set as ``model.lora_state``). Raises ValueError for a rank larger than a targeted layer's
    smaller dimension. Not a collective (every rank initialises the same full A from ``seed``)."""
    if getattr(model, "lora_state", None) is not None:
        raise ValueError("the model already has LoRA adapters")
    arch, info = model.arch, model.info
    tp = info.tp
    for t in cfg.target_modules:
        i, o, _, _ = _sizes(arch, tp, t)
        if cfg.rank > min(i, o):
            raise ValueError(f"trainer.lora.rank {cfg.rank} exceeds the smaller dimension ({min(i, o)}) of {t} in "
                             f"{base_path}: a low-rank adapter needs rank <= min(in, out)")
    model.requires_grad_(False)
    modules = []
    for li, layer in enumerate(model.layers):
        for attr, names in _PARTS.items():
            targets = [t for t in names if t in cfg.target_modules]
            if not targets:
                continue
            kind = _PLACES[names[0]][1]
            parts = [(t, _sizes(arch, tp, t)[2] // tp) for t in names]
            i_real, o_real, split, _ = _sizes(arch, tp, names[0])
            in_local = i_real if kind == "column" else split // tp
            lin = _linear(layer, attr)
            lin.lora = LoRALinear(kind, parts, targets, cfg.rank, in_local, o_real, cfg.scaling, cfg.dropout,
                                  info.tp_group, model.dtype).to(info.device)
            lin.register_forward_hook(_add_adapter)
            modules.append((li, attr, lin.lora))
    state = LoRAState(cfg, str(base_path), modules)
    model.lora_state = state
    gen = torch.Generator().manual_seed(seed)
    init: dict[str, torch.Tensor] = {}
    for li, _, mod in modules:
        for t in mod.lora_A:
            i_real, o_real, _, _ = _sizes(arch, tp, t)
            a_name, b_name = peft_names(li, t)
            bound = 1.0 / math.sqrt(i_real)
            init[a_name] = torch.empty(cfg.rank, i_real).uniform_(-bound, bound, generator=gen)
            init[b_name] = torch.zeros(o_real, cfg.rank)
    load_adapter_tensors(model, init)
    return state


def lora_state(model: nn.Module) -> LoRAState | None:
    """The model's ``LoRAState``, or None for a full fine-tuning model."""
    return getattr(model, "lora_state", None)


def _shard(full: torch.Tensor, dim: int, padded: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` after zero-padding that dim to ``padded``."""
    n = padded // tp
    shape = list(full.shape)
    shape[dim] = n
    out = torch.zeros(shape, dtype=full.dtype)
    lo, hi = min(rank * n, full.shape[dim]), min((rank + 1) * n, full.shape[dim])
    if hi > lo:
        out.narrow(dim, 0, hi - lo).copy_(full.narrow(dim, lo, hi - lo))
    return out


@torch.no_grad()
def load_adapter_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Set every adapter from full PEFT-named tensors (every rank passes the same full tensors and
    takes its shard). Raises KeyError / ValueError naming a missing, extra or misshapen tensor."""
    state = lora_state(model)
    if state is None:
        raise ValueError("the model has no LoRA adapters (trainer.lora is null)")
    arch, tp, r, rank = model.arch, model.info.tp, model.info.tp_rank, state.cfg.rank
    expected = set()
    for li, _, mod in state.modules:
        for t in mod.lora_A:
            i_real, o_real, split, _ = _sizes(arch, tp, t)
            a_name, b_name = peft_names(li, t)
            expected |= {a_name, b_name}
            for name, shape in ((a_name, (rank, i_real)), (b_name, (o_real, rank))):
                if name not in tensors:
                    raise KeyError(f"adapter tensor {name} is missing")
                if tuple(tensors[name].shape) != shape:
                    raise ValueError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
            a, b = tensors[a_name].to(torch.float32), tensors[b_name].to(torch.float32)
            if mod.kind == "column":
                b = _shard(b, 0, split, tp, r)
            else:
                a = _shard(a, 1, split, tp, r)
            mod.lora_A[t].copy_(a.to(mod.lora_A[t].dtype))
            mod.lora_B[t].copy_(b.to(mod.lora_B[t].dtype))
    extra = set(tensors) - expected
    if extra:
        raise ValueError(f"adapter tensors {sorted(extra)[:4]} match no targeted module of this model "
                         f"(targets: {', '.join(state.cfg.target_modules)})")


def _gather(local: torch.Tensor, dim: int, real: int, info: Any, copy: bool = True) -> torch.Tensor | None:
    """Full tensor on TP rank 0 (None elsewhere) from the shards along ``dim``, padding dropped
    (at TP=1 without ``copy``: a view of ``local``)."""
    if info.tp == 1:
        return local.narrow(dim, 0, real).clone() if copy else local.narrow(dim, 0, real)
    local = local.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(info.tp)] if info.tp_rank == 0 else None
    dist.gather(local, shards, group=info.tp_group, group_dst=0)
    if shards is None:
        return None
    return torch.cat(shards, dim=dim).narrow(dim, 0, real).contiguous()


def adapter_tensors(model: nn.Module, *, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full adapter tensor) pairs in the model's dtype, gathered over TP; yields on TP
    rank 0 only. A collective: every TP rank must exhaust the iterator. ``copy=False``: tensors not
    gathered are views of the parameters (for a caller done with them before the next step). All
    are detached (no ``no_grad`` wrapper: it cost a grad-mode switch per tensor yielded)."""
    state = lora_state(model)
    if state is None:
        raise ValueError("the model has no LoRA adapters (trainer.lora is null)")
    info = model.info
    for li, _, mod in state.modules:
        for t in mod.lora_A:
            _, _, _, real = _sizes(model.arch, info.tp, t)
            a_name, b_name = peft_names(li, t)
            a, b = mod.lora_A[t].detach(), mod.lora_B[t].detach()
            if mod.kind == "column":
                b = _gather(b, 0, real, info, copy)
                a = a.clone() if copy else a
            else:
                a = _gather(a, 1, real, info, copy)
                b = b.clone() if copy else b
            if info.tp_rank == 0:
                yield a_name, a
                yield b_name, b


def merge_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, *,
                 inplace: bool = False) -> torch.Tensor:
    """``w + scale * b @ a`` computed in fp32, returned in ``w``'s dtype (``inplace``: an fp32 ``w``
    that the caller owns is updated in place, one ``addmm_`` and no extra copy)."""
    if inplace and w.dtype == torch.float32:
        return w.addmm_(b.float(), a.float(), alpha=scale)
    return w.float().addmm(b.float(), a.float(), alpha=scale).to(w.dtype)


@torch.no_grad()
def merged_tensors(model: nn.Module, *, everything: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the targeted weights merged (``W + scale * B A``), or with ``everything``
    the whole HF state dict with those weights merged and every other tensor as the base holds it.
    Yields on TP rank 0 only; a collective over the TP group (exhaust it on every TP rank)."""
    from headrace.trainer.model.loading import gather_hf_tensors

    state = lora_state(model)
    if state is None:
        raise ValueError("the model has no LoRA adapters (trainer.lora is null)")
    adapters: dict[str, torch.Tensor] = dict(adapter_tensors(model))
    targets = {hf_module(li, t) + ".weight": (li, t) for li, _, mod in state.modules for t in mod.lora_A}
    only = None if everything else {f"layers.{li}.{attr}.weight" for li, attr, _ in state.modules}
    for name, w in gather_hf_tensors(model, only=only):
        if name in targets:
            a_name, b_name = peft_names(*targets[name])
            yield name, merge_weight(w, adapters[a_name], adapters[b_name], state.scale, inplace=True)  # w: a fresh gather
        elif everything:
            yield name, w


class AdaptersOff:
    """The KL reference of a LoRA model: the same model with its adapters disabled (the frozen
    base), in eval mode; only ``token_logprobs`` is offered (what ``train_step`` calls)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def token_logprobs(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        with adapters_disabled(self.model):
            return self.model.token_logprobs(*args, **kwargs)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its frozen base inside the block (adapters skipped), then restore them."""
    state = lora_state(model)
    mods = [m for _, _, m in state.modules] if state is not None else []
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


__all__ = ["LORA_TARGETS", "LoRAConfig", "LoRALinear", "LoRAState", "apply_lora", "lora_state", "load_adapter_tensors",
           "adapter_tensors", "merged_tensors", "merge_weight", "AdaptersOff", "adapters_disabled", "peft_names",
           "hf_module"]
