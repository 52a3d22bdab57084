"""Checked ``/generate`` answers: what the rollout service takes from an engine's answer, and how.

Guarantees of ``check_answer(out, url)``:
- it returns an ``Answer`` (a dict in SGLang's shape) whose ``output_ids`` are ints in [0, 2^31)
  and whose ``output_token_logprobs`` entries each start with a finite logprob <= 0 (within
  rounding above 0: clamped to 0), with ``finish_reason`` as a dict whose type is ``length``,
  ``stop`` or ``abort``; anything else is ``Retryable``, naming the problem;
- per-token checks run as numpy over the whole answer; an answer of at most ``_SHORT_ANSWER``
  tokens that is plainly valid is passed in plain Python first (numpy's fixed cost is more), with
  the same outcome;
- ``check_short_batch(outs)`` checks a batch answer's short answers in one pass (their ids and
  logprobs joined: two array conversions, not two per answer) and gives exactly what
  ``check_answer`` gives each, or None with nothing changed when any of them is not plainly valid.
"""

from __future__ import annotations

import array
import math
from typing import Any

import numpy as np

from headrace.shared.schemas import MAX_TOKEN_ID

class EngineError(RuntimeError):
    """An engine call that cannot succeed (4xx, malformed answers, retries exhausted)."""


class Retryable(RuntimeError):
    """An engine answer worth retrying on another engine (5xx, unusable body)."""


_SHORT_ANSWER = 128  # answers up to this many tokens try ``_plainly_valid`` first: numpy's fixed cost is more


def check_answer(out: Any, url: str) -> dict[str, Any]:
    """Validate the parts of a /generate answer we rely on; ``Retryable`` for garbage. Per-token
    checks run as numpy over the whole answer (one pass in C, not a Python test per token); a short
    answer that ``_plainly_valid`` accepts skips them (anything it doubts takes the numpy path, which
    alone words the errors and clamps)."""
    try:
        ids = out["output_ids"]
        meta = out["meta_info"]
        fr = finish_reason(meta["finish_reason"])
        lps = meta["output_token_logprobs"]
        if not isinstance(ids, list):
            raise ValueError("output_ids is not a list of token ids")
        if not isinstance(lps, list) or len(lps) != len(ids):
            raise ValueError(f"{len(lps) if isinstance(lps, list) else lps!r} logprobs for {len(ids)} tokens")
        meta["finish_reason"] = fr
        floats = _plainly_valid(ids, lps) if len(ids) <= _SHORT_ANSWER else None
        if floats is None and ids:
            try:   # array.array takes exactly ints ('q') / numbers ('d'): the type check, in C
                a = np.frombuffer(array.array("q", ids), dtype=np.int64)
            except (TypeError, OverflowError):
                raise ValueError("output_ids is not a list of token ids") from None
            if a.min() < 0 or a.max() > MAX_TOKEN_ID:
                raise ValueError("output_ids is not a list of token ids (each 0 <= id < 2^31)")
            try:
                floats = [x[0] for x in lps]
                first = np.frombuffer(array.array("d", floats), dtype=np.float64)
            except (TypeError, IndexError, KeyError, OverflowError):
                bad = next((x for x in lps if not _entry_ok(x)), lps[0])
                raise ValueError(f"bad output_token_logprobs entry {bad!r}") from None
            lo, hi = first.min(), first.max()   # all finite and <= 0 (the usual answer): two reductions
            if math.isfinite(lo) and hi <= 0:   # the arrays just checked go with it (``columns_push.Packed``)
                return Answer.of(out, lps, floats, (a, first))
            with np.errstate(invalid="ignore"):
                wrong = ~np.isfinite(first) | (first > 1e-6)
            if wrong.any():
                raise ValueError(f"bad output_token_logprobs entry {lps[int(np.argmax(wrong))]!r}")
            if (first > 0).any():  # within rounding of 0: clamp, as a logprob is never positive
                meta["output_token_logprobs"] = [[min(0.0, float(x[0])), *x[1:]] for x in lps]
                floats = [min(0.0, float(v)) for v in floats]
        elif floats is None:
            floats = []
        return Answer.of(out, meta["output_token_logprobs"], floats)
    except (KeyError, TypeError, ValueError) as e:
        raise Retryable(f"{url}/generate answered an unusable body ({type(e).__name__}: {e})") from None


def finish_reason(fr: Any) -> dict[str, Any]:
    """SGLang's finish_reason as a dict (a bare string is its ``type``); ValueError for an unknown type."""
    if isinstance(fr, str):
        fr = {"type": fr}
    if not isinstance(fr, dict) or fr.get("type") not in ("length", "stop", "abort"):
        raise ValueError(f"finish_reason {fr!r}")
    return fr


class Answer(dict):
    """A checked /generate answer: to its readers a plain dict in SGLang's shape; it also keeps its
    logprobs as a list of numbers (``logprobs``) for the entries list they were read from
    (``entries``), so the hot path walks the entries once (``logprobs_of``). ``arrays``, when not
    None: ``(output_ids, logprobs)`` as the int64 / float64 arrays ``check_answer`` checked, equal
    to the ``output_ids`` list and ``logprobs`` it was made with (the push reuses them instead of
    converting the lists again; ``columns_push.Packed`` checks they still match). A compact answer
    (``rollout.fast_answers``; only ``Transport.submit(compact=True)`` gives them) has ``entries``
    None and no ``output_token_logprobs`` in its ``meta_info``: ``entries_of`` builds them. Each
    answer the transport gives is its caller's alone (made for that one sequence), so the caller
    may complete it in place (``generate``)."""

    __slots__ = ("entries", "logprobs", "arrays")

    @classmethod
    def of(cls, out: dict[str, Any], entries: list[Any] | None, logprobs: list[float],
           arrays: tuple[np.ndarray, np.ndarray] | None = None) -> "Answer":
        a = cls(out)
        a.entries, a.logprobs, a.arrays = entries, logprobs, arrays
        return a


def logprobs_of(answer: dict[str, Any]) -> list[float]:
    """The logprob of each output token of a /generate answer (kept by ``Answer`` when its entries
    list is still the one it was made from, or when it is compact; read from the entries otherwise)."""
    entries = answer["meta_info"].get("output_token_logprobs")
    if isinstance(answer, Answer) and answer.entries is entries and (
            entries is None or len(answer.logprobs) == len(entries)):
        return answer.logprobs
    return [x[0] for x in answer["meta_info"]["output_token_logprobs"]]


def entries_of(answer: dict[str, Any]) -> list[Any]:
    """SGLang's ``[logprob, token id, null]`` entries of an answer; a compact answer's are built
    from its lists (and kept in its ``meta_info`` from then on)."""
    meta = answer["meta_info"]
    if "output_token_logprobs" not in meta and isinstance(answer, Answer) and answer.entries is None:
        meta["output_token_logprobs"] = answer.entries = make_entries(answer.logprobs, answer["output_ids"])
    return meta["output_token_logprobs"]


def make_entries(logprobs: list[float], ids: list[int]) -> list[list[Any]]:
    """SGLang's ``[logprob, token id, null]`` entries for these tokens."""
    return [[lp, t, None] for lp, t in zip(logprobs, ids)]


def _plainly_valid(ids: list[Any], lps: list[Any]) -> list[float] | None:
    """The logprobs of an answer that passes every check of the numpy path with nothing to clamp
    (ids ints in range, entries' logprobs finite numbers <= 0), for a few tokens in a few
    microseconds; None whenever that is not certain. The same ``array.array`` conversions decide
    the types; a finite float sum proves no NaN or infinity is among them."""
    try:
        floats = [x[0] for x in lps]
    except (TypeError, IndexError, KeyError):
        return None
    return floats if _plain_numbers(ids, floats) else None


def _plain_numbers(ids: list[Any], floats: list[Any]) -> bool:
    """Whether ``ids`` are ints in [0, 2^31) and ``floats`` as many finite numbers <= 0 (not empty).
    Past ``_NUMPY_FROM`` values numpy's reductions beat Python's (a batch of 32 16-token answers:
    ~17 against ~42 us)."""
    try:
        a = array.array("q", ids)
        f = array.array("d", floats)
    except (TypeError, OverflowError):
        return False
    if not a or len(f) != len(a):
        return False
    if len(a) >= _NUMPY_FROM:
        na, nf = np.frombuffer(a, dtype=np.int64), np.frombuffer(f, dtype=np.float64)
        return bool(na.min() >= 0 and na.max() <= MAX_TOKEN_ID and math.isfinite(nf.sum()) and nf.max() <= 0)
    if min(a) < 0 or max(a) > MAX_TOKEN_ID:
        return False
    return math.isfinite(sum(f)) and max(f) <= 0


_NUMPY_FROM = 96   # values from which ``_plain_numbers`` reduces with numpy (measured crossover)


def check_short_batch(outs: list[Any]) -> list[Answer] | None:
    """``check_answer`` of every answer of a batch at once, when each is short and plainly valid
    (``_plainly_valid``'s test, over the batch's joined ids and logprobs: two array conversions
    instead of two per answer); None, with nothing changed, when any is not (``check_answer`` then
    takes each, and words the errors)."""
    ids_all: list[Any] = []
    floats_all: list[Any] = []
    parts = []
    try:
        for out in outs:
            ids, meta = out["output_ids"], out["meta_info"]
            lps = meta["output_token_logprobs"]
            if type(ids) is not list or type(lps) is not list or not 0 < len(ids) == len(lps) <= _SHORT_ANSWER:
                return None
            floats = [x[0] for x in lps]
            parts.append((out, meta, finish_reason(meta["finish_reason"]), lps, floats))
            ids_all += ids
            floats_all += floats
    except (TypeError, IndexError, KeyError, ValueError):
        return None
    if not _plain_numbers(ids_all, floats_all):
        return None
    answers = []
    for out, meta, fr, lps, floats in parts:
        meta["finish_reason"] = fr
        answers.append(Answer.of(out, lps, floats))
    return answers


def _entry_ok(x: Any) -> bool:
    return (isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], (int, float)) and math.isfinite(x[0])
            and x[0] <= 1e-6)
