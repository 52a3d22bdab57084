"""SGLang ``sampling_params`` for the reference engine: parsing, validation and the batched sampler.

Guarantees:
- ``parse_sampling_params`` accepts SGLang's field names. Fields the engine implements are
  validated (a ``ValueError`` naming the field); SGLang fields it does not implement are accepted
  only at their neutral default, and unknown fields are refused, so a request never silently
  means something else here than on SGLang.
- ``temperature`` < 1e-6 is greedy (argmax), as in SGLang. ``top_k`` -1 (or 0) means no limit.
- Reported logprobs (``output_token_logprobs``) follow SGLang's definition by default
  (``mode="temperature"``): log softmax(logits / T) of the sampled token, i.e. after temperature
  but before top-p / top-k truncation (SGLang computes them from the tempered probabilities, not
  the renormalised truncated ones); greedy requests report log softmax(logits). ``mode="original"``
  reports log softmax(logits) always (SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), and
  ``mode="processed"`` the log-probability under the distribution actually sampled from (after
  temperature, top-k and top-p, renormalised). With top_p = 1 and top_k off, temperature and
  processed coincide.
- Sampling is inverse-CDF with one uniform number per row per step. A request with
  ``sampling_seed`` draws its numbers from its own generator, so its output depends only on the
  seed, the prompt and the weights, not on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

GREEDY_EPS = 1e-6
LOGPROB_MODES = ("temperature", "original", "processed")

# SGLang sampling fields this engine does not implement, with the value that means "off".
_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None,
    "custom_params": None, "logit_bias": None, "stop_regex": None,
}
# SGLang fields accepted and ignored (they only change text rendering details).
_IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval")


@dataclass
class SamplingParams:
    """One request's sampling parameters (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class LimitError(ValueError):
    """A value outside a bound of the engine (answered 422, not 400)."""


def _num(d: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"sampling_params.{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    return kind(v)


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate a ``sampling_params`` dict (or None) into ``SamplingParams``; ``ValueError`` if bad."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    known = set(SamplingParams.__dataclass_fields__) | set(_NEUTRAL) | set(_IGNORED)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {', '.join(unknown)}")
    for k, neutral in _NEUTRAL.items():
        if k in raw and raw[k] is not None and raw[k] != neutral:
            raise ValueError(f"sampling_params.{k}={raw[k]!r} is not supported by the reference engine "
                             f"(only {neutral!r})")
    sp = SamplingParams(
        max_new_tokens=_num(raw, "max_new_tokens", int, 128),
        temperature=_num(raw, "temperature", float, 1.0),
        top_p=_num(raw, "top_p", float, 1.0),
        top_k=_num(raw, "top_k", int, -1),
        n=_num(raw, "n", int, 1),
        ignore_eos=bool(raw.get("ignore_eos", False)),
        no_stop_trim=bool(raw.get("no_stop_trim", False)),
    )
    if sp.max_new_tokens < 0:
        raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    if not sp.temperature >= 0 or sp.temperature == float("inf"):
        raise ValueError(f"sampling_params.temperature must be a finite number >= 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise ValueError(f"sampling_params.top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k < -1:
        raise ValueError(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {sp.top_k}")
    if sp.top_k in (-1, 0) or sp.top_k >= vocab_size:
        sp.top_k = -1
    if not 1 <= sp.n <= 1024:
        raise LimitError(f"sampling_params.n must be in [1, 1024], got {sp.n}")
    stop = raw.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("sampling_params.stop must be a non-empty string or a list of non-empty strings")
        sp.stop = list(stop)
    ids = raw.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("sampling_params.stop_token_ids must be a list of integers")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        sp.stop_token_ids = list(ids)
    seed = raw.get("sampling_seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"sampling_params.sampling_seed must be an integer >= 0, got {seed!r}")
        sp.sampling_seed = seed
    return sp


class BatchSampler:
    """Samples one token per row from fp32 logits [B, V], each row with its own parameters."""

    def __init__(self, seed: int = 0, logprob_mode: str = "temperature") -> None:
        if logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"logprob mode {logprob_mode!r} is not one of {', '.join(LOGPROB_MODES)}")
        self.generator = torch.Generator().manual_seed(seed)
        self.logprob_mode = logprob_mode

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B] (int64) and their reported logprobs [B] (fp32, finite, <= 0)."""
        B, V = logits.shape
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        greedy = torch.tensor([p.greedy for p in params])
        scaled = logits / temps.view(B, 1)
        logp = torch.log_softmax(scaled, dim=-1)
        if bool(greedy.all()):
            ids = logits.argmax(dim=-1)
            return ids, self._report(logits, logp, logp, ids)
        probs = logp.exp()
        truncate = any(p.top_p < 1.0 or p.top_k > 0 for p in params if not p.greedy)
        u = torch.rand(B, generator=self.generator)
        for b, g in enumerate(generators):
            if g is not None:
                u[b] = torch.rand(1, generator=g)[0]
        if truncate:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            top_p = torch.tensor([p.top_p for p in params]).view(B, 1)
            top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params]).view(B, 1)
            before = sorted_p.cumsum(dim=-1) - sorted_p
            drop = ((before > top_p) & (top_p < 1.0)) | (torch.arange(V).view(1, V) >= top_k)
            kept = sorted_p.masked_fill(drop, 0.0)
            pick = self._inverse_cdf(kept, u)
            ids = order.gather(1, pick.view(B, 1)).view(B)
            processed = torch.log(kept / kept.sum(-1, keepdim=True))
            proc_full = torch.empty_like(processed).scatter_(1, order, processed)
        else:
            ids = self._inverse_cdf(probs, u)
            proc_full = logp
        ids = torch.where(greedy, logits.argmax(dim=-1), ids)
        return ids, self._report(logits, logp, proc_full, ids)

    @staticmethod
    def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        cdf = p.cumsum(dim=-1)
        target = (u * cdf[:, -1]).view(-1, 1)
        idx = torch.searchsorted(cdf, target, right=True).view(-1)
        return idx.clamp_(max=p.shape[1] - 1)

    def _report(self, logits: torch.Tensor, logp: torch.Tensor, processed: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        if self.logprob_mode == "original":
            src = torch.log_softmax(logits, dim=-1)
        elif self.logprob_mode == "processed":
            src = processed
        else:
            src = logp
        out = src.gather(1, ids.view(-1, 1)).view(-1)
        return out.clamp(min=torch.finfo(torch.float32).min)
