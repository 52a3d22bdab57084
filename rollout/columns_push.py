"""Checking generator output as columns: the rollout hot path's one validation of its samples.

A group's samples, as a user generator returned them, are checked together with numpy over their
concatenated token / loss-mask / logprob lists (one array per field for the whole group, not one
pydantic validation per sample): per-token work is a few C loops. Only samples the fast check
cannot clear (a flagged value, or a field of an unusual type, e.g. a numpy array) go through the
row schema (``Sample.model_validate``), which either names the problem in the words the buffer's
422 would use or returns the sample normalised (arrays to lists).

Guarantees of ``check_outputs(samples)``:
- a sample it passes satisfies every invariant of ``shared.schemas.Sample`` except the reward
  (checked after scoring) and the ids (``uid``, ``group_id``, ``index``, ``weight_version``: the
  loop sets them); ``status`` comes back as its string value;
- a sample it fails gets the row schema's message (``loss_mask: Value error, len(loss_mask) (3) !=
  response_length (4)``);
- booleans inside the numeric lists are taken as 0 / 1, as the columnar encoder takes them;
- the per-token checks are skipped for samples the caller marks as built from checked parts (the
  default generator's: ~13% of the service's CPU per 8 x 2,048-token group was this second pass
  over lists ``answers.check_answer`` had just checked), and every check for samples it marks
  ``ALL_VALID`` (``group_path``: a group whose first sample passed them, the others built alike).

``encode_groups(groups, packed)`` is the push's body: the groups as one columnar body
(``application/x-headrace-columns``), numeric columns converted in C (``array.array``) with no
per-token Python work; the buffer validates it. Rows that columns cannot carry exactly raise
``shared.columns.NotColumnar`` (the caller then sends rows, and the buffer's row schema names
the problem). A default-generator sample whose lists still equal the prompt and engine answer
they were made of is encoded from the arrays made when the answer was checked (``Packed``), not
converted again; the body is the same either way.

``copy_for_generator`` gives a generator its own sample: fresh lists and free-form containers, so
a generator that mutates its input in place cannot reach another sample (cheaper than a deep copy:
the token list is copied in C, free-form values only when they are containers).
"""

from __future__ import annotations

import array
import copy
import math
from typing import Any

import numpy as np
from pydantic import ValidationError

from headrace.shared import columns as cols
from headrace.shared.schemas import MAX_TOKEN_ID, Group, Sample, SampleStatus, plain_json

__all__ = ["Packed", "check_outputs", "clone_sample", "copy_for_generator", "encode_groups", "own_free_form",
           "revalidate"]

_STATUSES = frozenset(s.value for s in SampleStatus)
_SCALARS = (type(None), bool, int, float, str)


def copy_for_generator(base: Sample) -> Sample:
    """``base`` with its own mutable fields (see the module docstring)."""
    return clone_sample(base, {
        "tokens": list(base.tokens), "loss_mask": list(base.loss_mask),
        "rollout_logprobs": None if base.rollout_logprobs is None else list(base.rollout_logprobs),
        **own_free_form(base)})


_new = object.__new__
_set = object.__setattr__


def clone_sample(proto: Sample, fields: dict[str, Any]) -> Sample:
    """``proto.model_copy(update=fields)``: the same field values and fields set, not validated,
    without pydantic's copy machinery (~1 us less a sample, 8 in a group's tail on the hot path)."""
    if proto.__pydantic_extra__ is not None or getattr(proto, "__pydantic_private__", None) is not None:
        return proto.model_copy(update=fields)
    s = _new(type(proto))
    d = proto.__dict__.copy()
    d.update(fields)
    _set(s, "__dict__", d)
    _set(s, "__pydantic_fields_set__", proto.__pydantic_fields_set__ | fields.keys())
    _set(s, "__pydantic_extra__", None)
    _set(s, "__pydantic_private__", None)
    return s


def own_free_form(base: Sample) -> dict[str, Any]:
    """``label`` and ``metadata`` of ``base`` as values no other sample shares (containers copied)."""
    label = base.label
    return {"label": label if isinstance(label, _SCALARS) else copy.deepcopy(label),
            "metadata": {k: v if isinstance(v, _SCALARS) else copy.deepcopy(v) for k, v in base.metadata.items()}}


def revalidate(s: Sample) -> Sample:
    """The row schema's check of a generator's output (reward checked after scoring): the sample
    normalised, or ``ValidationError`` naming the field."""
    d = s.model_dump(warnings=False)   # the values may be of any type: the validation names them
    checked = Sample.model_validate({**d, "reward": d["reward"] if d["reward"] is not None else 0.0})
    if s.reward is None:
        checked = checked.model_copy(update={"reward": None})
    return checked


def _plain(s: Sample) -> bool:
    """Every non-list field has exactly the type the schema wants (O(1) but free-form values)."""
    if type(s.response_length) is not int or s.response_length < 0 or type(s.tokens) is not list:
        return False
    if type(s.loss_mask) is not list or not (s.rollout_logprobs is None or type(s.rollout_logprobs) is list):
        return False
    n = s.response_length
    if len(s.loss_mask) != n or n > len(s.tokens) or (s.rollout_logprobs is not None and len(s.rollout_logprobs) != n):
        return False
    st = s.status
    if isinstance(st, SampleStatus):
        s.status = st = st.value
    if st not in _STATUSES or not (s.prompt is None or type(s.prompt) is str):
        return False
    if not (s.response is None or type(s.response) is str) or type(s.metadata) is not dict:
        return False
    r = s.reward
    if not (r is None or (type(r) in (int, float) and abs(r) != float("inf") and r == r)):
        return False
    if not (isinstance(s.label, _SCALARS) and all(type(k) is str and isinstance(v, _SCALARS)
                                                  for k, v in s.metadata.items())):
        try:
            plain_json(s.label)
            plain_json(s.metadata)
        except ValueError:
            return False
        if not all(type(k) is str for k in s.metadata):
            return False
    return not (type(s.label) is int and not -(2**63) <= s.label < 2**63)


def _owners(offsets: np.ndarray, flags: np.ndarray) -> np.ndarray:
    hits = np.flatnonzero(flags)
    return np.searchsorted(offsets, hits, side="right") - 1 if hits.size else hits


def _flag_numbers(samples: list[Sample], field: str, typecode: str, bad: Any) -> np.ndarray | None:
    """Owners of values failing ``bad`` in ``field`` over all ``samples``; None when the joined
    values are not all of ``typecode`` ("q": ints, "d": numbers; then the row schema decides)."""
    flat: list[Any] = []
    offsets = [0]
    for s in samples:
        v = getattr(s, field)
        if v:
            flat.extend(v)
        offsets.append(len(flat))
    if not flat:
        return np.zeros(0, dtype=np.int64)
    try:   # array.array takes exactly ints / numbers, in C: the type check of every item
        a = np.frombuffer(array.array(typecode, flat), dtype=np.int64 if typecode == "q" else np.float64)
    except (TypeError, OverflowError):
        return None
    with np.errstate(invalid="ignore"):
        return _owners(np.asarray(offsets, dtype=np.int64), bad(a))


NUMBERS_VALID = 1   # a sample's tokens, loss_mask and rollout_logprobs are valid by construction
ALL_VALID = 2       # and so is every other field but the reward and the ids (``_plain`` holds)


def check_outputs(samples: list[Sample], numbers_valid: list[int] | None = None
                  ) -> list[tuple[Sample | None, str | None]]:
    """Each sample checked: ``(sample, None)`` when valid (possibly a normalised copy), ``(None,
    message)`` when not. ``numbers_valid[i]`` ``NUMBERS_VALID`` says sample ``i``'s ``tokens``,
    ``loss_mask`` and ``rollout_logprobs`` are valid by construction (the default generator's
    samples: tokenizer output plus engine answers that ``answers.check_answer`` checked); only its
    other fields are checked then; ``ALL_VALID`` says its other fields are too (``_plain`` holds:
    ``group_path`` tells for a group's samples at once), so nothing is checked."""
    plain = [(numbers_valid is not None and numbers_valid[i] == ALL_VALID) or _plain(s) for i, s in enumerate(samples)]
    index = [i for i, ok in enumerate(plain) if ok and not (numbers_valid and numbers_valid[i])]
    fast = [samples[i] for i in index]
    suspect: set[int] = set()
    if fast:
        checks = (("tokens", "q", lambda a: (a < 0) | (a > MAX_TOKEN_ID)),
                  ("loss_mask", "q", lambda a: (a != 0) & (a != 1)),
                  ("rollout_logprobs", "d", lambda a: ~np.isfinite(a) | (a > 0)))
        for field, typecode, bad in checks:
            owners = _flag_numbers(fast, field, typecode, bad)
            if owners is None:
                suspect.update(index)
                break
            suspect.update(index[j] for j in owners.tolist())
    out: list[tuple[Sample | None, str | None]] = []
    for i, s in enumerate(samples):
        if plain[i] and i not in suspect:
            out.append((s, None))
            continue
        try:
            out.append((revalidate(s), None))
        except ValidationError as e:
            out.append((None, short(e)))
    return out


def short(e: ValidationError) -> str:
    """The first three of a validation error's problems, each ``field: message``."""
    return "; ".join(f"{'.'.join(map(str, er['loc'])) or 'sample'}: {er['msg']}" for er in e.errors()[:3])


class Packed:
    """One group's token and logprob arrays, made where the default generator's values were checked
    (the tokenized prompt once, each engine answer's arrays from ``answers.check_answer``), so the
    push need not convert the samples' lists again (~0.9 ms of the service's CPU per 8 x 2,048-token
    group). The lists the arrays were made from are kept, private: a sample's arrays are used only
    while its own lists still equal them (``arrays_of``), so a reward or filter that changed a sample
    in place is encoded from its lists as before."""

    __slots__ = ("prompt", "prompt_arr", "answers", "used")

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = list(prompt)
        try:
            self.prompt_arr: np.ndarray | None = np.frombuffer(array.array("i", self.prompt), dtype=np.int32)
        except (TypeError, OverflowError):   # not int32 ids: its samples take the lists' path
            self.prompt_arr = None
        self.answers: dict[int, tuple[list[int], np.ndarray, list[float], np.ndarray]] = {}
        self.used: set[int] = set()   # the samples whose arrays ``arrays_of`` gave

    def add(self, index: int, ids: list[int], floats: list[float], arrays: tuple[np.ndarray, np.ndarray]) -> None:
        """Sample ``index``'s response: the answer's ``output_ids`` and logprobs lists with the
        checked arrays made from them (ids in [0, 2^31), logprobs finite and <= 0). The lists become
        this object's: the caller hands over lists nothing else holds (the loop's answers, which it
        drops; a sample got copies), so they keep the values the arrays were made from."""
        with np.errstate(over="ignore"):
            self.answers[index] = (ids, arrays[0].astype(np.int32), floats, arrays[1].astype(np.float32))

    def arrays_of(self, index: int, s: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``(response tokens, loss mask, logprobs)`` arrays of sample ``s`` when its lists still
        hold exactly the prompt and answer they were made of, with every response token trained
        on; None otherwise. List comparisons, in C: no per-item conversion. Values that compare
        equal count as unchanged (a reward that wrote ``1.0`` over a token ``1`` pushes ``1``)."""
        got = self.answers.get(index)
        if got is None or self.prompt_arr is None:
            return None
        ids, ids32, floats, lp32 = got
        t, m, lp, p, n = s.tokens, s.loss_mask, s.rollout_logprobs, len(self.prompt), len(ids)
        if not (type(t) is list and type(m) is list and type(lp) is list and s.response_length == n
                and len(t) == p + n and len(m) == n and len(lp) == n):
            return None
        if t[p:] != ids or t[:p] != self.prompt or lp != floats or m.count(1) != n:
            return None
        self.used.add(index)
        return ids32, np.ones(n, dtype=np.uint8), lp32


def encode_groups(groups: list[Group], packed: list[Packed | None] | None = None) -> bytes:
    """The columnar body of ``groups`` (see the module docstring); ``packed[i]``: group ``i``'s
    arrays, where the loop made them."""
    try:
        return _columns(groups, packed).pack()
    except (TypeError, ValueError, OverflowError, AttributeError):
        return cols.encode(groups)   # the exact encoder decides (NotColumnar: send rows)


def _columns(groups: list[Group], packed: list[Packed | None] | None = None) -> cols.Columns:
    gids, gmeta, soff = [], [], [0]
    uid, gi, status, wv, reward, toff, rl, hl, prompt, response, label, meta = ([] for _ in range(12))
    toks: list[int] = []   # the samples since the last packed one, as lists (converted together)
    mask: list[int] = []
    lps: list[float] = []
    tparts: list[np.ndarray] = []   # converted runs and packed samples' arrays, in order
    mparts: list[np.ndarray] = []
    lparts: list[np.ndarray] = []
    toff.append(0)
    n_tokens = 0
    for k, g in enumerate(groups):
        gids.append(g.group_id)
        gmeta.append(g.metadata)
        pk = packed[k] if packed else None
        for j, s in enumerate(g.samples):
            if type(s.response_length) is not int or len(s.loss_mask) != s.response_length or \
                    s.group_id != g.group_id or type(s.index) is not int or type(s.weight_version) is not int:
                raise ValueError("not plain")
            r, lp, st = s.reward, s.rollout_logprobs, s.status
            uid.append(s.uid)
            gi.append(s.index)
            status.append(st.value if isinstance(st, SampleStatus) else st)
            wv.append(s.weight_version)
            if not (r is None or (type(r) in (int, float) and math.isfinite(r))):
                raise ValueError("reward")
            reward.append(float("nan") if r is None else float(r))
            made = pk.arrays_of(j, s) if pk is not None else None
            if made is not None:
                if toks or mask or lps:
                    _convert(toks, mask, lps, tparts, mparts, lparts)
                    toks, mask, lps = [], [], []
                tparts += (pk.prompt_arr, made[0])   # type: ignore[union-attr]
                mparts.append(made[1])
                lparts.append(made[2])
            else:
                toks.extend(s.tokens)
                mask.extend(s.loss_mask)
                if lp is not None and len(lp) != s.response_length:
                    raise ValueError("logprobs")
                lps.extend(lp if lp is not None else (0.0,) * s.response_length)
            n_tokens += len(s.tokens)
            toff.append(n_tokens)
            rl.append(s.response_length)
            hl.append(lp is not None)
            prompt.append(s.prompt)
            response.append(s.response)
            label.append(s.label)
            meta.append(s.metadata)
        soff.append(len(uid))
    if any(type(x) is not str for x in status):
        raise ValueError("status")
    if toks or mask or lps or not tparts:
        _convert(toks, mask, lps, tparts, mparts, lparts)
    tokens, lp32, loss_mask = (x[0] if len(x) == 1 else np.concatenate(x) for x in (tparts, lparts, mparts))
    if not np.isfinite(lp32).all():
        raise ValueError("logprobs")   # the exact encoder decides what float32 cannot carry exactly
    if len(tokens) != n_tokens:
        raise ValueError("tokens")
    return cols.Columns(gids, gmeta, np.array(soff, dtype=np.int64), uid, np.array(gi, dtype=np.int32), status,
                        np.array(wv, dtype=np.int64), np.array(reward, dtype=np.float64), np.array(toff, dtype=np.int64),
                        tokens, np.array(rl, dtype=np.int32), loss_mask, np.array(hl, dtype=np.uint8), lp32,
                        prompt, response, label, meta)


def _convert(toks: list[int], mask: list[int], lps: list[float], tparts: list[np.ndarray],
             mparts: list[np.ndarray], lparts: list[np.ndarray]) -> None:
    """Append the arrays of a run of samples' joined lists. array.array takes exactly ints ("i":
    int32, "B": 0..255) / numbers ("d"), in C; a positive logprob raises (the exact encoder decides)."""
    lp64 = np.frombuffer(array.array("d", lps), dtype=np.float64)
    if (lp64 > 0).any():
        raise ValueError("logprobs")
    with np.errstate(over="ignore"):
        lparts.append(lp64.astype(np.float32))
    tparts.append(np.frombuffer(array.array("i", toks), dtype=np.int32))
    mparts.append(np.frombuffer(array.array("B", mask), dtype=np.uint8))
