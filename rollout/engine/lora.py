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
import os
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
    and per slice (out lo, out hi, rank lo, rank hi, B); the scale alpha / r multiplies x A^T."""

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


class _Safetensors:
    """One safetensors file, read as the format defines it: an 8-byte little-endian header length,
    a JSON header ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__"?}`` and the
    tensors' bytes, packed without gaps (what ``safetensors`` itself checks on open). Opening reads
    the raw header; ``parse`` checks it into ``entries``; ``read`` then copies the data with one
    ``preadv`` per 1024 tensors (one copy from the page cache) and ``view`` gives a tensor of it."""

    SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
    FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    MAX_HEADER = 16 << 20

    def __init__(self, f: Any) -> None:
        self.f = f
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(self.MAX_HEADER, size - 8):
            raise AdapterError(f"{WEIGHTS} is not a safetensors file (header length {n}, file {size} bytes)")
        self.raw = f.read(n)
        self.start, self.length = 8 + n, size - 8 - n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}

    def parse(self) -> None:
        """Parse and check the header (``entries``); every problem is an ``AdapterError``."""
        try:
            header = json.loads(self.raw)
        except ValueError as e:
            raise AdapterError(f"{WEIGHTS}: the header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise AdapterError(f"{WEIGHTS}: the header is not a JSON object")
        header.pop("__metadata__", None)
        for name, e in header.items():
            ok = isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list) \
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2 \
                and all(type(x) is int and x >= 0 for x in [*e["shape"], *e["data_offsets"]])
            if not ok:
                raise AdapterError(f"{WEIGHTS}: header entry {name!r} is not {{dtype, shape, data_offsets}}")
            if e["dtype"] not in self.SIZES:
                raise AdapterError(f"{WEIGHTS}: {name} has unknown dtype {e['dtype']!r}")
            b, end = e["data_offsets"]
            if end - b != math.prod(e["shape"]) * self.SIZES[e["dtype"]]:
                raise AdapterError(f"{WEIGHTS}: {name}'s data_offsets {[b, end]} do not fit its shape "
                                   f"{e['shape']} and dtype {e['dtype']}")
            self.entries[name] = (e["dtype"], tuple(e["shape"]), b, end)
        at = 0
        for name, (_, _, b, end) in sorted(self.entries.items(), key=lambda kv: kv[1][2:]):
            if b != at:
                raise AdapterError(f"{WEIGHTS}: {name}'s bytes start at {b}, expected {at} (overlap or gap)")
            at = end
        if at != self.length:
            raise AdapterError(f"{WEIGHTS}: the tensors take {at} bytes but the file holds {self.length} after "
                               "its header (truncated or padded)")

    def read(self, place: dict[str, int], size: int) -> torch.Tensor:
        """Every tensor's bytes into one new buffer of ``size`` bytes, tensor ``n`` at ``place[n]``
        (all tensors of the file, laid out as the caller wants them): one copy from the page cache,
        one ``preadv`` per 1024 tensors, as the file holds them back to back."""
        buf = torch.empty(size, dtype=torch.uint8)
        mv = memoryview(buf.numpy())
        order = sorted(self.entries.items(), key=lambda kv: kv[1][2])
        for i in range(0, len(order), 1024):      # IOV_MAX
            run = order[i:i + 1024]
            views = [mv[place[n]:place[n] + e - b] for n, (_, _, b, e) in run if e > b]
            pos, want = self.start + run[0][1][2], run[-1][1][3] - run[0][1][2]
            while want:
                got = os.preadv(self.f.fileno(), views, pos)
                if got <= 0:
                    raise AdapterError(f"{WEIGHTS} changed while it was read (ended {want} bytes early)")
                pos, want = pos + got, want - got
                while views and got >= len(views[0]):
                    got -= len(views[0])
                    views.pop(0)
                if got:
                    views[0] = views[0][got:]
        return buf

    def view(self, buf: torch.Tensor, at: int, name: str, rows: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (a float dtype, checked by the caller) at byte ``at`` of ``buf``; with
        ``rows``, that many rows of its width (several tensors stacked)."""
        dtype, shape, b, e = self.entries[name]
        shape = (rows, *shape[1:]) if rows is not None else shape
        n = math.prod(shape) * self.SIZES[dtype]
        return buf[at:at + n].view(self.FLOATS[dtype]).view(shape)


def read_adapter(name: str, path: str, model: Any, engine_models: Sequence[str], dirs: WeightDirs) -> LoraAdapter:
    """The adapter of PEFT directory ``path`` for ``model``, checked (see the module docstring);
    ``engine_models``: the names the engine's base model goes by (the first is shown in errors)."""
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
    mats: dict[tuple[int, str], tuple[str, int, int, int]] = {}
    try:
        with open(files[1], "rb") as f:
            fh = _Safetensors(f)
            key = (fh.raw, fh.length, r, tuple(targets), model.dtype)
            plan = _PLANS.get(key)
            if plan is not None and plan.model is model:    # the header checked before, byte for byte
                return LoraAdapter(name=name, path=path, r=r, alpha=alpha, target_modules=targets,
                                   fused=plan.load(fh))
            fh.parse()
            if len(fh.entries) > 2 * len(TARGETS) * a.num_layers:
                raise AdapterError(f"{WEIGHTS} holds {len(fh.entries)} tensors: more than this model's LoRA modules")
            for n, (dtype, shape, _, _) in fh.entries.items():
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
                if (layer, proj) not in mats:
                    mats[layer, proj] = _matrix_of(model, proj, layer)
                _, lo, hi, fan_in = mats[layer, proj]
                want = (r, fan_in) if ab == "A" else (hi - lo, r)
                if shape != want:
                    raise AdapterError(f"{WEIGHTS}: {n} has shape {list(shape)}, expected {list(want)} "
                                       f"(rank r={r} of {CONFIG} and this model's {proj})")
                if dtype not in _Safetensors.FLOATS:
                    raise AdapterError(f"{WEIGHTS}: {n} has dtype {dtype}; floating point expected")
                found.setdefault((layer, proj), {})[ab] = n
            half = [f"layer {lay} {p} (lora_{'B' if 'A' in ab else 'A'} missing)"
                    for (lay, p), ab in found.items() if len(ab) != 2]
            if half:
                raise AdapterError(f"{WEIGHTS}: incomplete modules: {', '.join(half[:5])}")
            if not found:
                raise AdapterError(f"{WEIGHTS} holds no LoRA tensors")
            plan = _Plan(model, found, mats, fh)
            fused = plan.load(fh)
            _PLANS.clear()                                 # one layout at a time: a sync repeats it
            _PLANS[key] = plan
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file: inside an allowed directory, say what failed
        raise AdapterError(f"{WEIGHTS} could not be read: {type(e).__name__}: {e}") from None
    return LoraAdapter(name=name, path=path, r=r, alpha=alpha, target_modules=targets, fused=fused)


class _Plan:
    """How one checked adapter layout becomes tensors: where each tensor goes in the buffer the file
    is read into (the A of a matrix's slices back to back, so the stacked A is a view when they
    share a dtype; else they are concatenated) and, per internal matrix, its slices. A weight sync
    loads the same layout every version, so ``read_adapter`` keeps the plan of the last header it
    checked and, for a byte-identical header on the same model, skips parsing and checking it again
    and builds the views from offsets (``as_strided``) instead of one slicing chain per tensor."""

    def __init__(self, model: Any, found: dict[tuple[int, str], dict[str, str]],
                 mats: dict[tuple[int, str], tuple[str, int, int, int]], fh: _Safetensors) -> None:
        self.model, self.entries = model, fh.entries
        per_key: dict[str, list[tuple[int, int, str, str]]] = {}
        for (layer, proj), ab in sorted(found.items(), key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
            key, lo, hi, _ = mats[layer, proj]
            per_key.setdefault(key, []).append((lo, hi, ab["A"], ab["B"]))
        self.per_key, self.place, at = per_key, {}, 0
        for parts in per_key.values():
            for n in [p[2] for p in parts] + [p[3] for p in parts]:
                dt, _, b, e = fh.entries[n]
                at += -at % fh.SIZES[dt]                 # aligned for its dtype (no gap when all share one)
                self.place[n] = at
                at += e - b
        self.size = at
        dtypes = {dt for dt, *_ in fh.entries.values()}
        # all in the model's dtype: per matrix (key, A offset and shape, [(lo, hi, r0, r1, B offset, shape)])
        self.fast: list[tuple[str, int, tuple[int, int], list[tuple[int, int, int, int, int, tuple[int, ...]]]]] = []
        if dtypes == {next((k for k, v in fh.FLOATS.items() if v == model.dtype), "")}:
            item = fh.SIZES[dtypes.pop()]
            for key, parts in per_key.items():
                a_shape = fh.entries[parts[0][2]][1]
                ranks = [fh.entries[p[2]][1][0] for p in parts]
                slices, r0 = [], 0
                for (lo, hi, _, bn), r in zip(parts, ranks):
                    slices.append((lo, hi, r0, r0 + r, self.place[bn] // item, fh.entries[bn][1]))
                    r0 += r
                self.fast.append((key, self.place[parts[0][2]] // item, (sum(ranks), a_shape[1]), slices))

    def load(self, fh: _Safetensors) -> dict[str, _Fused]:
        """Read ``fh``'s data (its header is this plan's) into one new buffer and return the fused
        adapter tensors, views of it (converted to the model's dtype where the file's differs)."""
        fh.entries = self.entries
        buf = fh.read(self.place, self.size)
        out: dict[str, _Fused] = {}
        if self.fast:
            flat = buf.view(self.model.dtype)
            for key, a_off, a_shape, slices in self.fast:
                f = _Fused(a=flat.as_strided(a_shape, (a_shape[1], 1), a_off))
                f.slices = [(lo, hi, r0, r1, flat.as_strided(shape, (shape[1], 1), off))
                            for lo, hi, r0, r1, off, shape in slices]
                out[key] = f
            return out
        dtype = self.model.dtype
        for key, parts in self.per_key.items():
            a_names = [p[2] for p in parts]
            ranks = [fh.entries[n][1][0] for n in a_names]
            if len({fh.entries[n][0] for n in a_names}) == 1:
                a = fh.view(buf, self.place[a_names[0]], a_names[0], rows=sum(ranks))
            else:
                a = torch.cat([fh.view(buf, self.place[n], n).to(torch.float32) for n in a_names])
            f = _Fused(a=a.to(dtype))
            r0 = 0
            for (lo, hi, _, bn), r in zip(parts, ranks):
                f.slices.append((lo, hi, r0, r0 + r, fh.view(buf, self.place[bn], bn).to(dtype)))
                r0 += r
            out[key] = f
        return out


_PLANS: dict[tuple[Any, ...], _Plan] = {}


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
            xa = (x[rows] @ f.a.T).mul_(ad.scale)                    # [b, T, sum of ranks]
            for lo, hi, r0, r1, b in f.slices:
                d = xa[..., r0:r1] @ b.T                             # [b, T, hi - lo]
                if isinstance(rows, slice):
                    out[..., lo:hi] += d
                else:
                    out[rows, :, lo:hi] += d
        return out
