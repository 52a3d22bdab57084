"""Tokenizer-side helpers of the reference engine: loading, EOS ids, stop strings, output text.

Guarantees:
- ``load_tokenizer_or_none`` loads ``tokenizer.json`` the way the model zoo does
  (``PreTrainedTokenizerFast``, never AutoTokenizer, whose qwen2 pre-tokenizer changes ids); a
  directory without a tokenizer gives None and the engine then accepts only ``input_ids`` (like
  SGLang's ``--skip-tokenizer-init``) and answers ``text`` as "".
- ``eos_token_ids`` is the union of config.json's, generation_config.json's and the tokenizer's
  EOS ids, which is what SGLang stops on unless ``ignore_eos``.
- Stop strings are matched like SGLang: in the decoded tail of the output (the last
  ``stop_token_len + 1`` tokens). The returned text is cut before the first stop string unless
  ``no_stop_trim``; ``output_ids`` always keep every generated token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer_or_none(model_dir: str | Path) -> Any:
    d = Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        return None
    try:
        from headrace.shared.modelzoo import load_tokenizer
    except ImportError:  # the model zoo is optional for the engine
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), clean_up_tokenization_spaces=False)
    return load_tokenizer(d)


def _ids(v: Any) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, int):
        return {v}
    return {int(x) for x in v if isinstance(x, int)}


def eos_token_ids(model_dir: str | Path, config_eos: Any, tokenizer: Any) -> set[int]:
    ids = _ids(config_eos)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        ids |= _ids(json.loads(gen.read_text()).get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class TextCodec:
    """Encode prompts, decode outputs and match stop strings with one tokenizer (or none)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    @property
    def available(self) -> bool:
        return self.tok is not None

    def encode(self, text: str) -> list[int]:
        if self.tok is None:
            raise ValueError("this model directory has no tokenizer.json: send input_ids instead of text")
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_text(self, tid: int) -> str:
        return "" if self.tok is None else self.tok.decode([tid])

    def stop_token_len(self, stops: list[str]) -> int:
        if self.tok is None:
            return 0
        return max(len(self.tok.encode(s, add_special_tokens=False)) for s in stops)

    def matched_stop(self, output: list[int], stops: list[str], tail_tokens: int) -> str | None:
        """The first stop string found in the decoded tail of ``output``, or None."""
        if self.tok is None or not stops:
            return None
        tail = self.tok.decode(output[-(tail_tokens + 1):])
        for s in stops:
            if s in tail:
                return s
        return None

    def output_text(self, output: list[int], stop: str | None, trim: bool) -> str:
        text = self.decode(output)
        if stop is not None and trim:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
        return text
