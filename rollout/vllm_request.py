"""SGLang's /generate request and answer terms in vLLM's: the translation rules of the vLLM adapter.

``rollout.vllm_backend`` serves SGLang's routes in front of vLLM; this module holds what it checks
and maps, with no I/O:
- ``check_generate_keys(body)``: a body with a key outside ``GENERATE_KEYS`` is a ``BadRequest``
  naming it, except SGLang's ``INERT_KEYS`` at values that change nothing here (sglang-router
  0.3.2 sends each of them with every request, at SGLang's defaults); another value of one of
  those is a ``BadRequest`` naming the key and the values accepted;
- ``to_vllm_sampling(sp)``: SGLang's sampling params as vLLM's (an unknown key is a
  ``BadRequest`` naming it; ``logprobs: 0`` asks for the sampled token's logprob);
- ``finish_reason(choice, max_tokens, aborted)``: vLLM's finish / stop reason as SGLang's.
"""

from __future__ import annotations

import json
from typing import Any

# SGLang sampling key -> vLLM sampling key (None: accepted and dropped, it changes nothing here)
SAMPLING_KEYS: dict[str, str | None] = {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "n": "n", "seed": "seed", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "skip_special_tokens": None, "no_stop_trim": None,
    "spaces_between_special_tokens": None,
}
GENERATE_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "lora_path"}
# SGLang /generate keys accepted only at values that change nothing here (sglang-router 0.3.2 sends
# each of them with every request, at SGLang's defaults); any other value is a 400 naming the key
INERT_KEYS: dict[str, tuple[Any, ...]] = {
    "model": (None,), "stream": (False,), "return_text_in_logprobs": (False,), "return_hidden_states": (False,),
    "return_entropy": (False,), "return_bytes": (False,), "background": (False,), "log_metrics": (True, False),
    "no_logs": (True, False),
}


class BadRequest(ValueError):
    """A request this adapter refuses (400 naming the problem)."""


def to_vllm_sampling(sp: dict[str, Any]) -> dict[str, Any]:
    """SGLang sampling_params -> vLLM's (``logprobs: 0``: the sampled token's logprob)."""
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - set(SAMPLING_KEYS))
    if unknown:
        raise BadRequest(f"sampling_params: unsupported key(s) {unknown} for a vLLM engine "
                         f"(supported: {sorted(SAMPLING_KEYS)})")
    out: dict[str, Any] = {"max_tokens": 128}
    for k, v in sp.items():
        name = SAMPLING_KEYS[k]
        if name is not None and v is not None:
            out[name] = [v] if name == "stop" and isinstance(v, str) else v
    if out.get("top_k") == 0:
        out["top_k"] = -1
    out["logprobs"] = 0
    return out


def finish_reason(choice: dict[str, Any], max_tokens: int, aborted: bool) -> dict[str, Any]:
    """vLLM's finish_reason / stop_reason -> SGLang's ``{"type", ...}``."""
    fr, why = choice.get("finish_reason"), choice.get("stop_reason")
    if aborted or fr == "abort":
        return {"type": "abort"}
    if fr == "length":
        return {"type": "length", "length": max_tokens}
    ids = choice.get("token_ids") or []
    return {"type": "stop", "matched": why if why is not None else (ids[-1] if ids else None)}


def check_generate_keys(body: dict[str, Any]) -> None:
    """``BadRequest`` naming a /generate key this adapter does not take (see the module docstring)."""
    unknown = sorted(set(body) - GENERATE_KEYS - set(INERT_KEYS))
    if unknown:
        raise BadRequest(f"unsupported /generate key(s) {unknown} for a vLLM engine (supported: {sorted(GENERATE_KEYS)}, "
                         f"and {sorted(INERT_KEYS)} at SGLang's defaults)")
    for k in sorted(set(body) & set(INERT_KEYS)):
        if not any(body[k] is v for v in INERT_KEYS[k]):   # JSON's null / true / false are singletons
            raise BadRequest(f"{k}: {json.dumps(body[k])[:100]} is not supported by a vLLM engine here "
                             f"(only {' or '.join(json.dumps(v) for v in INERT_KEYS[k])})")
