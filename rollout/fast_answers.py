"""Batch ``/generate`` answers read without a Python object per token (the default generator's groups).

SGLang answers each token's logprob as a ``[logprob, token id, null]`` list. For a group of 8 x
2,048 tokens that is ~50k Python objects out of orjson, read once and freed again. Here each
answer's entries are turned into one flat JSON array of numbers inside the body's bytes (one
``bytes.translate``: ``[`` ``]`` become spaces and ``null`` becomes ``7e99``), simdjson
(``pysimdjson``) parses the body without making Python objects, and each answer's ids and
logprobs come out as numpy arrays (``as_buffer``). In ``bench/fleet_sim.py`` the rollout
service's CPU per group fell from 5.1 to 3.0 ms (8 x 2,048 tokens; 2-core machine).

Guarantees of ``parse_batch(body, n)``:
- it returns ``n`` ``(answer, logprobs, arrays)``: the answer dict's ``text``, ``output_ids`` and
  other fields equal what ``orjson.loads`` gives for the same body, but its ``meta_info`` has no
  ``output_token_logprobs`` (``finish_reason`` as the engine wrote it: ``transport`` checks it
  and makes the compact ``Answer``s); ``logprobs`` are each entry's first element, as
  ``check_answer`` reads them; ``arrays`` the int64 ids and float64 logprobs (also for short
  answers, for which ``check_answer`` keeps none; None for an empty answer);
- it returns None for anything it is not sure of, and the caller then takes that path, which
  alone words the errors: not a list of ``n`` objects, a body simdjson refuses, entries that are
  not ``[number, the same id as output_ids, null]``, ids that are not integers in [0, 2^31) in a
  flat list, logprobs that are not all finite and <= 0 (the old path clamps or refuses positive
  ones), a finish_reason ``check_answer`` would refuse; also without ``pysimdjson``;
- nothing of the body is kept: the arrays and lists are copies.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from headrace.shared.schemas import MAX_TOKEN_ID

try:
    import simdjson
except ImportError:  # a platform without pysimdjson's wheels: the orjson path serves every answer
    simdjson = None

_KEY = b'"output_token_logprobs":['
_IDS = b'"output_ids":['
_NULL = 7e99   # what ``null`` reads as here: no logprob, id or null entry reads so by accident
_FLAT = bytes.maketrans(b"[]nul", b"  7e9")   # [a,5,null],[b,6,null] -> " a,5,7e99 , b,6,7e99 "
_local = threading.local()


def available() -> bool:
    return simdjson is not None


def _flatten(body: bytes, n: int) -> tuple[bytes, list[int]] | None:
    """``body`` with each answer's entries as one flat array of numbers, and how many ``[`` each
    answer's entries held (one per entry when no entry nests a list); None if it does not hold ``n``
    entry lists, or holds an ``output_ids`` list that is not flat. An entry list holds no string
    (the first ``"`` after its start is past its end); every ``null`` in it becomes ``7e99`` (a
    null logprob or id then reads as a positive number or a wrong id: ``_one`` refuses both)."""
    parts: list[bytes] = []
    lists: list[int] = []
    pos = look = 0   # pos: the first byte not yet in parts; look: where the next key is looked for
    while (k := body.find(_KEY, look)) >= 0:
        s = look = k + len(_KEY)
        if body[s:s + 1] == b"]":   # no tokens: nothing to flatten
            lists.append(0)
            continue
        q = body.find(b'"', s)
        e = body.rfind(b"]]", s, len(body) if q < 0 else q)
        if e < 0:
            return None
        seg = body[s:e + 1]
        lists.append(seg.count(b"["))
        parts += (body[pos:s], seg.translate(_FLAT))
        pos = look = e + 1
    if len(lists) != n:
        return None
    parts.append(body[pos:])
    pos = 0
    while (k := body.find(_IDS, pos)) >= 0:   # simdjson's as_buffer would flatten [[1], [2]]
        s = k + len(_IDS)
        e = body.find(b"]", s)
        if e < 0 or body.find(b"[", s, e) >= 0:
            return None
        pos = e
    return b"".join(parts), lists


Parsed = tuple[dict[str, Any], list[float], tuple[np.ndarray, np.ndarray] | None]


def parse_batch(body: bytes, n: int) -> list[Parsed] | None:
    """The module docstring's guarantees."""
    if simdjson is None:
        return None
    flattened = _flatten(body, n)
    if flattened is None:
        return None
    flat, lists = flattened
    parser = getattr(_local, "parser", None)
    if parser is None:   # one per thread, kept: a new one maps and faults in its buffers each time
        parser = _local.parser = simdjson.Parser()
    try:
        doc = parser.parse(flat)
        if not isinstance(doc, simdjson.Array) or len(doc) != n:
            return None
        return [_one(o, m) for o, m in zip(doc, lists)]
    except (ValueError, TypeError, KeyError, RuntimeError):
        return None
    finally:
        doc = None  # no proxy outlives the call: the parser's next parse needs none alive


def _one(o: Any, lists: int) -> Parsed:
    """One answer (``lists``: the ``[`` its entries held); raises (ValueError, TypeError, KeyError)
    where the orjson path must decide."""
    if not isinstance(o, simdjson.Object):
        raise TypeError("not an object")
    meta_o = o["meta_info"]
    ids = np.frombuffer(o["output_ids"].as_buffer(of_type="i"), dtype=np.int64)
    entries = np.frombuffer(meta_o["output_token_logprobs"].as_buffer(of_type="d"), dtype=np.float64)
    k = len(ids)
    if lists != k or len(entries) != 3 * k or not np.array_equal(entries[1::3], ids) or \
            (k and not (entries[2::3] == _NULL).all()):
        raise ValueError("entries are not [logprob, id, null]")
    if k and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID):
        raise ValueError("id out of range")
    lps = np.ascontiguousarray(entries[0::3])
    if k and not (np.isfinite(lps.min()) and lps.max() <= 0):
        raise ValueError("a logprob to clamp or refuse")
    meta = {key: _py(meta_o[key]) for key in meta_o.keys() if key != "output_token_logprobs"}
    out = {key: _py(o[key]) for key in o.keys() if key not in ("output_ids", "meta_info")}
    out["output_ids"] = ids.tolist()
    out["meta_info"] = meta
    # (the ids' copy: not a view of simdjson's buffer; an empty answer keeps no arrays, as before)
    return out, lps.tolist(), (ids.copy(), lps) if k else None


def _py(v: Any) -> Any:
    """A simdjson value as plain Python (containers converted; numbers and strings already are)."""
    if isinstance(v, simdjson.Object):
        return v.as_dict()
    if isinstance(v, simdjson.Array):
        return v.as_list()
    return v
