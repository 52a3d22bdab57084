"""Random-init model presets (Qwen2, Qwen3, Llama; ~100K to ~5M parameters), written offline.

Guarantees of ``write_random_model``: the directory holds config.json, model.safetensors (fp32,
Hugging Face tensor names), generation_config.json, tokenizer.json and tokenizer_config.json; the
weights are a pure function of (preset, seed) — the same bytes on every call — and
``transformers.AutoModelForCausalLM`` loads the directory. Weights are drawn by our own seeded
generator (normal(0, 0.02) for matrices and embeddings, ones for norms, zeros for biases), not by
transformers' initialisers, so they do not change with the transformers version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headrace.shared.modelzoo.tokenizer import (CHATML_TEMPLATE, EOS, IM_END, build_tokenizer, save_tokenizer,
                                       tokenizer_config)


@dataclass(frozen=True)
class Preset:
    """Shape of one random-init preset."""

    model_type: str            # qwen2 | qwen3 | llama
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    tied: bool
    head_dim: int | None = None
    description: str = ""
    tool_phrases: bool = False     # tokenizer: the tool template's fixed text as single tokens


PRESETS: dict[str, Preset] = {
    "tiny-qwen2": Preset("qwen2", 128, 4, 4, 2, 512, True,
                         description="the CPU demo model: Qwen2, width 128, 4 layers, tied, ~1M params"),
    "tiny-qwen2-tools": Preset("qwen2", 128, 4, 4, 2, 512, True, tool_phrases=True,
                               description="tiny-qwen2 whose tokenizer has single tokens for the tool "
                                           "template's fixed text (the agent example's model)"),
    "tiny-llama": Preset("llama", 128, 4, 4, 2, 512, False, description="Llama, width 128, 4 layers, untied, ~1.1M"),
    "micro-qwen2": Preset("qwen2", 64, 2, 4, 2, 128, True, description="Qwen2, width 64, 2 layers, ~100K"),
    "qwen2-5m": Preset("qwen2", 256, 6, 4, 2, 768, True, description="Qwen2, width 256, 6 layers, ~5M"),
    "qwen3-tiny": Preset("qwen3", 128, 4, 4, 2, 512, True, head_dim=32,
                         description="Qwen3 (qk-norm), width 128, 4 layers, ~1M"),
    "llama-5m": Preset("llama", 256, 6, 4, 2, 768, False, description="Llama, width 256, 6 layers, untied, ~5M"),
}

MAX_POSITIONS = 2048


def hf_config(p: Preset, vocab_size: int, eos_id: int, im_end_id: int) -> dict[str, Any]:
    """The ``config.json`` of a preset."""
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[p.model_type]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": p.model_type,
        "vocab_size": vocab_size,
        "hidden_size": p.hidden,
        "intermediate_size": p.mlp,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim or p.hidden // p.heads,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": p.tied,
        "use_cache": True,
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if p.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif p.model_type == "qwen3":
        cfg.update(attention_bias=False)
    if p.model_type in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.layers)
    return cfg


def random_state_dict(p: Preset, vocab_size: int, seed: int) -> dict[str, Any]:
    """HF-named fp32 tensors for a preset, drawn from ``torch.Generator().manual_seed(seed)``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hd = p.head_dim or p.hidden // p.heads

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * 0.02

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, p.hidden)}
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = torch.ones(p.hidden)
        sd[pre + "post_attention_layernorm.weight"] = torch.ones(p.hidden)
        sd[pre + "self_attn.q_proj.weight"] = normal(p.heads * hd, p.hidden)
        sd[pre + "self_attn.k_proj.weight"] = normal(p.kv_heads * hd, p.hidden)
        sd[pre + "self_attn.v_proj.weight"] = normal(p.kv_heads * hd, p.hidden)
        sd[pre + "self_attn.o_proj.weight"] = normal(p.hidden, p.heads * hd)
        if p.model_type == "qwen2":
            sd[pre + "self_attn.q_proj.bias"] = torch.zeros(p.heads * hd)
            sd[pre + "self_attn.k_proj.bias"] = torch.zeros(p.kv_heads * hd)
            sd[pre + "self_attn.v_proj.bias"] = torch.zeros(p.kv_heads * hd)
        if p.model_type == "qwen3":
            sd[pre + "self_attn.q_norm.weight"] = torch.ones(hd)
            sd[pre + "self_attn.k_norm.weight"] = torch.ones(hd)
        sd[pre + "mlp.gate_proj.weight"] = normal(p.mlp, p.hidden)
        sd[pre + "mlp.up_proj.weight"] = normal(p.mlp, p.hidden)
        sd[pre + "mlp.down_proj.weight"] = normal(p.hidden, p.mlp)
    sd["model.norm.weight"] = torch.ones(p.hidden)
    if not p.tied:
        sd["lm_head.weight"] = normal(vocab_size, p.hidden)
    return sd


def write_random_model(name: str, out: Path, seed: int) -> Path:
    """Write preset ``name`` with weights from ``seed`` into ``out`` (created if missing)."""
    from safetensors.torch import save_file

    p = PRESETS[name]
    tok = build_tokenizer(tool_phrases=p.tool_phrases)
    n_tokens = tok.get_vocab_size()
    vocab_size = -(-n_tokens // 64) * 64          # rows past the tokenizer are never produced as input
    eos_id, im_end_id = tok.token_to_id(EOS), tok.token_to_id(IM_END)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(p, vocab_size, eos_id, im_end_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": eos_id, "eos_token_id": [eos_id, im_end_id], "pad_token_id": eos_id,
           "do_sample": True, "temperature": 1.0, "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    sd = random_state_dict(p, vocab_size, seed)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # one key: safetensors orders metadata by hash
    save_tokenizer(tok, out, tokenizer_config(EOS, EOS, CHATML_TEMPLATE, model_max_length=MAX_POSITIONS))
    return out
