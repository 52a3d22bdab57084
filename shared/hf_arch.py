"""The decoder architectures Headrace runs (Qwen2, Qwen3, Llama), read from a HF ``config.json``.

Both the trainer's tensor-parallel model and the reference engine's batched model build from
``ArchConfig`` and share the numerics defined here (RMSNorm, rotary embeddings with the HF rope
settings), so train-side and inference-side logprobs agree by construction. Functions taking
tensors import torch lazily: importing this module does not import torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class ArchConfig:
    """Hyper-parameters of one decoder-only model, as HF names them (normalised)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool            # Qwen2: True; Llama: config.attention_bias; Qwen3: False
    o_bias: bool              # Llama attention_bias also biases o_proj
    mlp_bias: bool
    qk_norm: bool             # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ArchConfig":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED:
            raise ValueError(f"model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        attn_bias = bool(cfg.get("attention_bias", False))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta/scaling in here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        return cls(
            model_type=mt,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default") else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else (attn_bias if mt == "llama" else bool(cfg.get("attention_bias", False))),
            o_bias=attn_bias if mt in ("llama", "qwen3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=mt == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ArchConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
        return cls.from_dict(json.loads(path.read_text()))


def rope_inv_freq(arch: ArchConfig) -> "torch.Tensor":
    """Inverse frequencies [head_dim/2] (float32), honouring HF's default and llama3 rope types."""
    import torch

    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = arch.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def rope_cos_sin(inv_freq: "torch.Tensor", positions: "torch.Tensor", dtype: "torch.dtype") -> tuple["torch.Tensor", "torch.Tensor"]:
    """cos, sin of shape [*positions.shape, head_dim] (HF's half-split layout), computed in fp32."""
    import torch

    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """Rotate ``x`` [..., tokens, heads, head_dim] with cos/sin [..., tokens, head_dim] (HF rotate_half)."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def rms_norm(x: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
    """HF RMSNorm: normalise in fp32, cast back, then scale."""
    import torch

    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
