"""LoRA adapters on the reference engine: read a PEFT directory, check it strictly, apply it per row.

A PEFT LoRA directory is ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules`` as a list, ``base_model_name_or_path``) and ``adapter_model.safetensors`` with
PEFT's names, ``base_model.model.<module path>.lora_A.weight`` ([r, in]) and ``.lora_B.weight``
([out, r]). The adapter adds ``(lora_alpha / r) * B (A x)`` to each targeted linear's output, as
PEFT's ``LoraLayer`` and SGLang's LoRA backends do; on fused matrices (q/k/v, gate/up) it adds to
the slice of its module.

Guarantees:
- ``read_adapter`` checks everything before it returns, so a bad directory never leaves anything
  half-loaded: the directory and every file it opens resolve below the engine's allowed weight
  directories (``confine.WeightDirs``: otherwise ``AdapterError`` 403 with ``LORA_REFUSED``, which
  names no path); the config is a LoRA of plain PEFT form (no DoRA, rsLoRA, rank/alpha patterns,
  modules_to_save, biases or fan_in_fan_out); its base model is the engine's; its target modules
  are among the seven this engine adapts (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
  down_proj); every tensor name is a PEFT LoRA name of a targeted module of this model, every
  module has both A and B, and every shape is [r, in] / [out, r] for this model (checked from the
  file's header before any tensor is read). Each problem is one ``AdapterError`` (400) naming it.
- ``LoraBatch`` applies per row: rows of one forward may use different adapters or none; a row
  without one gets exactly the base model's output.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from headrace.rollout.engine.confine import Refused, WeightDirs

__all__ = ["AdapterError", "LoraAdapter", "LoraBatch", "read_adapter", "TARGETS", "LORA_REFUSED"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_REFUSED = ("lora_path is outside the directories this engine may load weights from "
                "(the model directory and --allowed-weight-dirs)")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_RANK = 4096
_NAME = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")
# settings that change the math: refused unless they hold PEFT's plain-LoRA value
_PLAIN = {"use_dora": (False, None), "use_rslora": (False, None), "rank_pattern": ({}, None),
          "alpha_pattern": ({}, None), "modules_to_save": (None, []), "bias": ("none", None),
          "fan_in_fan_out": (False, None), "lora_bias": (False, None), "target_parameters": (None, []),
          "trainable_token_indices": (None,), "alora_invocation_tokens": (None,)}


class AdapterError(ValueError):
    """An adapter this engine cannot load; ``status`` is the HTTP status (400, or 403 when confined)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Fused:
    """The adapters of one internal matrix: A of every targeted slice stacked (one x A^T for all),
    and per slice (out lo, out hi, rank lo, rank hi, scale x B)."""

    a: torch.Tensor
    slices: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class LoraAdapter:
    """One loaded adapter: its name, directory, rank, alpha and the per-matrix deltas."""

    name: str
    path: str
    r: int
    alpha: float
    target_modules: list[str]
    fused: dict[str, _Fused]

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def nbytes(self) -> int:
        return sum(f.a.numel() * f.a.element_size() + sum(b.numel() * b.element_size() for *_, b in f.slices)
                   for f in self.fused.values())


def _matrix_of(model: Any, proj: str, layer: int) -> tuple[str, int, int, int]:
    """(internal key, out lo, out hi, in features) of HF module ``proj`` of ``layer``."""
    a = model.arch
    kind = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    key, lo, hi = model._hf_map()[f"model.layers.{layer}.{kind}.{proj}.weight"]
    ins = {"qkv": a.hidden_size, "gu": a.hidden_size, "o": model.q_size, "down": a.intermediate_size}
    return key, lo, hi, ins[key.split(".", 1)[1]]


def _same_base(base: Any, engine_models: Sequence[str]) -> bool:
    if not isinstance(base, str) or not base:
        return False
    for m in engine_models:
        if base == m:
            return True
        try:
            if Path(base).resolve() == Path(m).resolve():
                return True
        except (OSError, RuntimeError, ValueError):
            pass
    return False


def _config(d: Path, engine_models: Sequence[str]) -> tuple[int, float, list[str]]:
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"the adapter directory has no {CONFIG}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{CONFIG} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG} must hold a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{CONFIG}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters load here")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        raise AdapterError(f"{CONFIG}: r must be an integer in [1, {MAX_RANK}], got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{CONFIG}: lora_alpha must be a number > 0, got {alpha!r}")
    for key, ok in _PLAIN.items():
        if cfg.get(key) not in ok:
            raise AdapterError(f"{CONFIG}: {key}={cfg.get(key)!r} is not supported by this engine "
                               f"(plain LoRA only: {key} must be {ok[0]!r})")
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{CONFIG}: target_modules must be a non-empty list of module names "
                           f"(no regular expressions), got {targets!r}")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise AdapterError(f"{CONFIG}: target modules {bad} are not in this model's adaptable modules "
                           f"(valid: {', '.join(TARGETS)})")
    base = cfg.get("base_model_name_or_path")
    if not _same_base(base, engine_models):
        raise AdapterError(f"the adapter's base model {base!r} (base_model_name_or_path) is not this "
                           f"engine's model {engine_models[0]!r}")
    return r, float(alpha), sorted(set(targets), key=TARGETS.index)


def read_adapter(name: str, path: str, model: Any, engine_models: Sequence[str], dirs: WeightDirs) -> LoraAdapter:
    """The adapter of PEFT directory ``path`` for ``model``, checked (see the module docstring);
    ``engine_models``: the names the engine's base model goes by (the first is shown in errors)."""
    from safetensors import safe_open

    try:
        d = dirs.check(path)
        if not d.is_dir():
            raise AdapterError(f"lora_path {path!r} is not a directory")
        files = [(d / CONFIG).resolve(), (d / WEIGHTS).resolve()]
        if not all(dirs.allows(f) for f in files):
            raise Refused()
    except Refused:
        raise AdapterError(LORA_REFUSED, 403) from None
    r, alpha, targets = _config(d, engine_models)
    if not files[1].is_file():
        raise AdapterError(f"the adapter directory has no {WEIGHTS} (only safetensors adapters load here)")
    a = model.arch
    found: dict[tuple[int, str], dict[str, str]] = {}
    try:
        with safe_open(str(files[1]), framework="pt") as fh:
            names = list(fh.keys())
            if len(names) > 2 * len(TARGETS) * a.num_layers:
                raise AdapterError(f"{WEIGHTS} holds {len(names)} tensors: more than this model's LoRA modules")
            for n in names:
                m = _NAME.match(n)
                if m is None:
                    raise AdapterError(f"{WEIGHTS}: {n!r} is not a PEFT LoRA tensor name "
                                       "(base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight)")
                layer, kind, proj, ab = int(m.group(2)), m.group(3), m.group(4), m.group(5)
                want_kind = "self_attn" if proj in TARGETS[:4] else "mlp"
                if proj not in TARGETS or kind != want_kind or layer >= a.num_layers:
                    raise AdapterError(f"{WEIGHTS}: {n!r} names module {m.group(1)}, which this model "
                                       f"({a.num_layers} layers) does not have")
                if proj not in targets:
                    raise AdapterError(f"{WEIGHTS}: {n!r} adapts {proj}, which is not in target_modules {targets}")
                _, lo, hi, fan_in = _matrix_of(model, proj, layer)
                want = (r, fan_in) if ab == "A" else (hi - lo, r)
                sl = fh.get_slice(n)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if shape != want:
                    raise AdapterError(f"{WEIGHTS}: {n} has shape {list(shape)}, expected {list(want)} "
                                       f"(rank r={r} of {CONFIG} and this model's {proj})")
                if dtype not in ("F32", "BF16", "F16", "F64"):
                    raise AdapterError(f"{WEIGHTS}: {n} has dtype {dtype}; floating point expected")
                found.setdefault((layer, proj), {})[ab] = n
            half = [f"layer {lay} {p} (lora_{'B' if 'A' in ab else 'A'} missing)"
                    for (lay, p), ab in found.items() if len(ab) != 2]
            if half:
                raise AdapterError(f"{WEIGHTS}: incomplete modules: {', '.join(half[:5])}")
            if not found:
                raise AdapterError(f"{WEIGHTS} holds no LoRA tensors")
            fused = _fuse(model, found, fh, alpha / r)
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file: inside an allowed directory, say what failed
        raise AdapterError(f"{WEIGHTS} could not be read: {type(e).__name__}: {e}") from None
    return LoraAdapter(name=name, path=path, r=r, alpha=alpha, target_modules=targets, fused=fused)


def _fuse(model: Any, found: dict[tuple[int, str], dict[str, str]], fh: Any, scale: float) -> dict[str, _Fused]:
    dtype = model.dtype
    per_key: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), ab in sorted(found.items(), key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
        key, lo, hi, _ = _matrix_of(model, proj, layer)
        A = fh.get_tensor(ab["A"]).to(torch.float32)
        B = fh.get_tensor(ab["B"]).to(torch.float32) * scale
        per_key.setdefault(key, []).append((lo, hi, A.to(dtype), B.to(dtype)))
    out = {}
    for key, parts in per_key.items():
        f = _Fused(a=torch.cat([A for _, _, A, _ in parts]).contiguous())
        r0 = 0
        for lo, hi, A, B in parts:
            f.slices.append((lo, hi, r0, r0 + A.shape[0], B.contiguous()))
            r0 += A.shape[0]
        out[key] = f
    return out


class LoraBatch:
    """The adapters of the rows of one forward; ``add`` puts their deltas onto a linear's output."""

    def __init__(self, per_row: Sequence[LoraAdapter | None]) -> None:
        groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for i, ad in enumerate(per_row):
            if ad is not None:
                groups.setdefault(id(ad), (ad, []))[1].append(i)
        n = len(per_row)
        self.groups = [(ad, slice(None) if len(rows) == n else torch.tensor(rows)) for ad, rows in groups.values()]

    @classmethod
    def of(cls, seqs: Sequence[Any]) -> "LoraBatch | None":
        """For sequences with a ``lora`` attribute; None when no row uses an adapter."""
        per_row = [s.lora for s in seqs]
        return cls(per_row) if any(a is not None for a in per_row) else None

    def add(self, out: torch.Tensor, x: torch.Tensor, key: str) -> torch.Tensor:
        """``out`` [B, T, N] += each row's adapter delta for internal matrix ``key`` of input ``x`` [B, T, in]."""
        for ad, rows in self.groups:
            f = ad.fused.get(key)
            if f is None:
                continue
            xa = x[rows] @ f.a.T                                     # [b, T, sum of ranks]
            for lo, hi, r0, r1, b in f.slices:
                d = xa[..., r0:r1] @ b.T                             # [b, T, hi - lo]
                if isinstance(rows, slice):
                    out[..., lo:hi] += d
                else:
                    out[rows, :, lo:hi] += d
        return out
