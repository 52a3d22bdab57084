"""The reference engine's batched decoder (Qwen2 / Qwen3 / Llama) with a slot-based KV cache.

Guarantees:
- The architecture and numerics come from ``shared.hf_arch`` (``ArchConfig``, RoPE tables from
  ``rope_inv_freq``/``rope_cos_sin``, ``apply_rope``, ``rms_norm``), the same code the trainer uses,
  so engine logprobs match the trainer's and ``transformers``' to float tolerance.
- Weights are addressed by their Hugging Face names. ``load_weights`` copies HF-named tensors into
  the model (q/k/v and gate/up are stored fused; a name maps to a slice), casting dtype; an unknown
  name or a wrong shape raises ``ValueError`` naming it, before anything is copied.
- ``forward`` works on rows ``[row0, row0 + B)`` of a ``KVCache``: prefill (right-padded prompts,
  written at positions ``0..T-1``) or decode (one token per row at position ``lens[b]``). Padding
  never leaks into valid positions: prefill is causal and decode masks keys past each row's length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F

from headrace.shared.hf_arch import ArchConfig, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` means float32 (the CPU engine computes in fp32 unless told otherwise)."""
    if name == "auto":
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (auto, {', '.join(DTYPES)})")
    return DTYPES[name]


class KVCache:
    """K and V of every layer for up to ``rows`` sequences of up to ``capacity`` positions.

    Shape of ``k``/``v``: [layers, rows, kv_heads, capacity, head_dim]. Rows are owned by the
    scheduler (row i = i-th running sequence); the cache grows on demand and ``move`` compacts it.
    """

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, rows: int = 8, capacity: int = 256) -> None:
        self.arch, self.dtype = arch, dtype
        self.k = self.v = torch.empty(0)
        self._alloc(rows, capacity)

    def _alloc(self, rows: int, capacity: int) -> None:
        a = self.arch
        shape = (a.num_layers, rows, a.num_kv_heads, capacity, a.head_dim)
        k, v = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)
        if self.k.numel():
            r, c = min(rows, self.rows), min(capacity, self.capacity)
            k[:, :r, :, :c] = self.k[:, :r, :, :c]
            v[:, :r, :, :c] = self.v[:, :r, :, :c]
        self.k, self.v = k, v

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def ensure(self, rows: int, capacity: int) -> None:
        """Grow (never shrink) so that ``rows`` rows of ``capacity`` positions fit."""
        if rows > self.rows or capacity > self.capacity:
            new_rows = max(self.rows, rows) if rows <= self.rows else max(rows, 2 * self.rows)
            new_cap = max(self.capacity, capacity) if capacity <= self.capacity else max(capacity, 2 * self.capacity)
            self._alloc(new_rows, min(new_cap, max(capacity, self.arch.max_position_embeddings)))

    def move(self, src: int, dst: int) -> None:
        """Copy row ``src`` into row ``dst`` (used to keep running rows contiguous)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class DecoderModel:
    """A decoder-only transformer held as plain tensors (no nn.Module: nothing to trace or hook)."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32, use_onednn: bool = True) -> None:
        self.arch, self.dtype = arch, dtype
        a = arch
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.inv_freq = rope_inv_freq(a)
        positions = torch.arange(a.max_position_embeddings)
        self.cos, self.sin = rope_cos_sin(self.inv_freq, positions, dtype)
        self.params: dict[str, torch.Tensor] = {}
        self._packed: dict[str, torch.Tensor] | None = None
        self._map: dict[str, tuple[str, int, int]] | None = None
        self.use_onednn = use_onednn and dtype == torch.float32 and torch.backends.mkldnn.is_available()
        self._allocate()

    # ---- parameters ------------------------------------------------------------------------

    def _allocate(self) -> None:
        """Every parameter as a view of one flat buffer, laid out in the order the trainer sends its
        Hugging Face tensors (embedding, final norm, untied head, then per layer: norms, q/k/v,
        o, gate/up, down, each weight followed by its bias): a weight-sync bucket of consecutive
        tensors is then one contiguous range, received in place with one collective."""
        a, d = self.arch, self.dtype
        qkv, gu = self.q_size + 2 * self.kv_size, 2 * a.intermediate_size
        spec: list[tuple[str, tuple[int, ...], float]] = [("embed", (a.vocab_size, a.hidden_size), 0.0),
                                                          ("norm", (a.hidden_size,), 1.0)]
        if not a.tie_word_embeddings:
            spec.append(("lm_head", (a.vocab_size, a.hidden_size), 0.0))
        for i in range(a.num_layers):
            spec += [(f"{i}.ln1", (a.hidden_size,), 1.0), (f"{i}.ln2", (a.hidden_size,), 1.0),
                     (f"{i}.qkv", (qkv, a.hidden_size), 0.0)]
            spec += [(f"{i}.qkv_b", (qkv,), 0.0)] if a.qkv_bias else []
            spec += [(f"{i}.o", (a.hidden_size, self.q_size), 0.0)]
            spec += [(f"{i}.o_b", (a.hidden_size,), 0.0)] if a.o_bias else []
            spec += [(f"{i}.qn", (a.head_dim,), 1.0), (f"{i}.kn", (a.head_dim,), 1.0)] if a.qk_norm else []
            spec += [(f"{i}.gu", (gu, a.hidden_size), 0.0)]
            spec += [(f"{i}.gu_b", (gu,), 0.0)] if a.mlp_bias else []
            spec += [(f"{i}.down", (a.hidden_size, a.intermediate_size), 0.0)]
            spec += [(f"{i}.down_b", (a.hidden_size,), 0.0)] if a.mlp_bias else []
        flat = torch.empty(sum(math.prod(shape) for _, shape, _ in spec), dtype=d)
        at = 0
        for key, shape, init in spec:
            n = math.prod(shape)
            self.params[key] = flat[at:at + n].view(shape).fill_(init)
            at += n
        if a.tie_word_embeddings:
            self.params["lm_head"] = self.params["embed"]

    def _hf_map(self) -> dict[str, tuple[str, int, int]]:
        """HF name -> (internal key, row start, row end) of the slice the tensor fills (built once:
        weight sync asks for every tensor's view on every update)."""
        if self._map is None:
            self._map = self._build_hf_map()
        return self._map

    def _build_hf_map(self) -> dict[str, tuple[str, int, int]]:
        a = self.arch
        q, kv, inter = self.q_size, self.kv_size, a.intermediate_size
        m: dict[str, tuple[str, int, int]] = {"model.embed_tokens.weight": ("embed", 0, a.vocab_size),
                                              "model.norm.weight": ("norm", 0, a.hidden_size),
                                              "lm_head.weight": ("lm_head", 0, a.vocab_size)}
        for i in range(a.num_layers):
            pre = f"model.layers.{i}."
            m[pre + "input_layernorm.weight"] = (f"{i}.ln1", 0, a.hidden_size)
            m[pre + "post_attention_layernorm.weight"] = (f"{i}.ln2", 0, a.hidden_size)
            for j, (name, lo, hi) in enumerate((("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))):
                m[pre + f"self_attn.{name}_proj.weight"] = (f"{i}.qkv", lo, hi)
                if a.qkv_bias:
                    m[pre + f"self_attn.{name}_proj.bias"] = (f"{i}.qkv_b", lo, hi)
            m[pre + "self_attn.o_proj.weight"] = (f"{i}.o", 0, a.hidden_size)
            if a.o_bias:
                m[pre + "self_attn.o_proj.bias"] = (f"{i}.o_b", 0, a.hidden_size)
            if a.qk_norm:
                m[pre + "self_attn.q_norm.weight"] = (f"{i}.qn", 0, a.head_dim)
                m[pre + "self_attn.k_norm.weight"] = (f"{i}.kn", 0, a.head_dim)
            m[pre + "mlp.gate_proj.weight"] = (f"{i}.gu", 0, inter)
            m[pre + "mlp.up_proj.weight"] = (f"{i}.gu", inter, 2 * inter)
            m[pre + "mlp.down_proj.weight"] = (f"{i}.down", 0, a.hidden_size)
            if a.mlp_bias:
                m[pre + "mlp.gate_proj.bias"] = (f"{i}.gu_b", 0, inter)
                m[pre + "mlp.up_proj.bias"] = (f"{i}.gu_b", inter, 2 * inter)
                m[pre + "mlp.down_proj.bias"] = (f"{i}.down_b", 0, a.hidden_size)
        return m

    def hf_names(self) -> list[str]:
        """Every HF tensor name the model holds (lm_head only when untied)."""
        return [n for n in self._hf_map() if n != "lm_head.weight" or not self.arch.tie_word_embeddings]

    def get_weight(self, name: str) -> torch.Tensor:
        """The tensor of HF name ``name`` (a view into the fused storage)."""
        m = self._hf_map()
        if name not in m:
            raise KeyError(f"unknown weight name {name!r}")
        key, lo, hi = m[name]
        return self.params[key][lo:hi]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor view) for every weight, in HF order."""
        for n in self.hf_names():
            yield n, self.get_weight(n)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model; returns how many were copied.

        All names and shapes are checked before the first copy, so a bad batch changes nothing.
        ``lm_head.weight`` of a tied model is accepted and written into the shared embedding.
        Non-parameter buffers such as ``rotary_emb.inv_freq`` are skipped.
        """
        m = self._hf_map()
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, t in named_tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in m:
                raise ValueError(f"load_weights: unknown weight name {name!r} for {self.arch.model_type}")
            key, lo, hi = m[name]
            if key not in self.params:
                raise ValueError(f"load_weights: weights are released; resume memory before loading {name!r}")
            dst = self.params[key][lo:hi]
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            staged.append((dst, t))
        with torch.no_grad():
            for dst, t in staged:
                if dst.data_ptr() != t.data_ptr():   # received in place (``param_view``): nothing to copy
                    dst.copy_(t.to(dst.dtype))
        self._packed = None
        return len(staged)

    def param_view(self, name: str) -> torch.Tensor | None:
        """The model's own storage for HF weight ``name`` (a contiguous view), or None.

        Weight sync receives straight into it (no second copy of the model); ``load_weights`` then
        sees the same tensor and only drops the prepacked matmul weights."""
        entry = self._hf_map().get(name)
        if entry is None or entry[0] not in self.params:
            return None
        key, lo, hi = entry
        view = self.params[key][lo:hi]
        return view if view.is_contiguous() else None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> "DecoderModel":
        arch = ArchConfig.from_model_dir(model_dir)
        model = cls(arch, dtype)
        n = model.load_weights(iter_safetensors(model_dir))
        missing = len(model.hf_names()) - n
        if missing > 0:
            raise ValueError(f"{model_dir}: {missing} weights missing from the safetensors files")
        return model

    def release(self) -> None:
        """Drop every parameter tensor (the memory goes back to the allocator)."""
        self.params.clear()
        self._packed = None

    def reallocate(self) -> None:
        self._allocate()
        self._packed = None

    @property
    def released(self) -> bool:
        return not self.params

    def nbytes(self) -> int:
        seen = {id(t): t for t in [*self.params.values(), *(self._packed or {}).values()]}
        return sum(t.numel() * t.element_size() for t in seen.values())

    # ---- matmuls ----------------------------------------------------------------------------

    _MATRICES = ("qkv", "o", "gu", "down")

    def _pack(self) -> dict[str, torch.Tensor]:
        """oneDNN-prepacked copies of the weight matrices (rebuilt after every weight change).

        On x86 CPUs oneDNN's prepacked fp32 GEMM is 1.5-3x faster than the default BLAS call
        for these small matrices; results agree with ``F.linear`` to fp32 rounding (~1e-6).
        """
        packed = {}
        names = ["lm_head"] + [f"{i}.{m}" for i in range(self.arch.num_layers) for m in self._MATRICES]
        for n in names:
            packed[n] = torch.ops.mkldnn._reorder_linear_weight(self.params[n].contiguous())
        return packed

    def _linear(self, x: torch.Tensor, key: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_onednn:
            if self._packed is None:
                try:
                    self._packed = self._pack()
                except RuntimeError:  # oneDNN not usable on this CPU / build: plain BLAS from now on
                    self.use_onednn = False
                    return F.linear(x, self.params[key], bias)
            return torch.ops.mkldnn._linear_pointwise(x, self._packed[key], bias, "none", [], "")
        return F.linear(x, self.params[key], bias)

    # ---- forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache, row0: int,
                lens: torch.Tensor | None = None, last: torch.Tensor | None = None, lora: Any = None) -> torch.Tensor:
        """Logits [B, V] (fp32) of one position per row.

        Prefill (``lens is None``): ``input_ids`` [B, T] right-padded, written at positions 0..T-1
        of cache rows row0..row0+B-1; ``last`` [B] picks the position whose logits are returned.
        Decode: ``input_ids`` [B, 1] at position ``lens[b]`` of row row0+b (``lens`` = tokens
        already cached per row). ``lora`` (a ``rollout.engine.lora.LoraBatch``, or None) adds each
        row's adapter delta to the outputs of the q/k/v, o, gate/up and down matrices.
        """
        a, p = self.arch, self.params
        B, T = input_ids.shape
        rows = slice(row0, row0 + B)
        decode = lens is not None
        if decode:
            pos = lens.view(B, 1)
            kv_len = int(lens.max()) + 1
            keep = torch.arange(kv_len).view(1, kv_len) <= pos            # [B, kv_len]
            mask = keep.view(B, 1, 1, kv_len)
            cos, sin = self.cos[pos], self.sin[pos]                       # [B, 1, hd]
        else:
            cos, sin = self.cos[:T].unsqueeze(0), self.sin[:T].unsqueeze(0)
        h = F.embedding(input_ids, p["embed"])
        eps, H, KH, hd = a.rms_norm_eps, a.num_heads, a.num_kv_heads, a.head_dim
        bidx = torch.arange(B)
        for i in range(a.num_layers):
            x = rms_norm(h, p[f"{i}.ln1"], eps)
            qkv = self._linear(x, f"{i}.qkv", p.get(f"{i}.qkv_b"))
            if lora is not None:
                lora.add(qkv, x, f"{i}.qkv")
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q, k, v = q.view(B, T, H, hd), k.view(B, T, KH, hd), v.view(B, T, KH, hd)
            if a.qk_norm:
                q, k = rms_norm(q, p[f"{i}.qn"], eps), rms_norm(k, p[f"{i}.kn"], eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc, vc = cache.k[i], cache.v[i]                               # [rows, KH, cap, hd]
            if decode:
                r = bidx + row0
                kc[r, :, lens] = k[:, 0]
                vc[r, :, lens] = v[:, 0]
                keys, values = kc[rows, :, :kv_len], vc[rows, :, :kv_len]
                # one query per row: fold each KV head's query heads into the query axis (no KV repeat)
                qg = q.reshape(B, KH, (H // KH) * T, hd)
                o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask).view(B, H, T, hd)
            else:
                kc[rows, :, :T] = k.transpose(1, 2)
                vc[rows, :, :T] = v.transpose(1, 2)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, enable_gqa=H != KH)
            o = o.transpose(1, 2).reshape(B, T, H * hd)
            attn = self._linear(o, f"{i}.o", p.get(f"{i}.o_b"))
            h = h + (attn if lora is None else lora.add(attn, o, f"{i}.o"))
            x = rms_norm(h, p[f"{i}.ln2"], eps)
            gu = self._linear(x, f"{i}.gu", p.get(f"{i}.gu_b"))
            gate, up = (gu if lora is None else lora.add(gu, x, f"{i}.gu")).chunk(2, dim=-1)
            act = F.silu(gate) * up
            down = self._linear(act, f"{i}.down", p.get(f"{i}.down_b"))
            h = h + (down if lora is None else lora.add(down, act, f"{i}.down"))
        if decode:
            h = h[:, 0]
        else:
            h = h[bidx, last if last is not None else torch.full((B,), T - 1)]
        h = rms_norm(h, p["norm"], eps)
        return self._linear(h, "lm_head").float()


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from every ``*.safetensors`` file of a HF model directory."""
    from safetensors import safe_open

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors files")
    for f in files:
        with safe_open(str(d / f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
