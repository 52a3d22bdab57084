"""The columnar wire format (``application/x-headrace-columns``, DESIGN.md "Columnar wire format").

One msgpack map: ``format``, a ``groups`` map and a ``samples`` map of columns; numeric columns
are msgpack ``bin`` holding little-endian arrays, the others lists. Samples are laid out group by
group; a sample's response is the last ``response_length`` of its tokens, and its loss_mask /
logprob slice starts at the sum of the earlier samples' response_length.

Guarantees:
- ``decode`` accepts a body only if it is exactly this layout (every column present, no unknown
  one, known ``format``, byte lengths whole numbers of items, column lengths and offsets
  consistent) *and* every group satisfies the row schema (``shared.schemas.Group``). Checks are
  vectorised with numpy; when one fails, the offending group is rebuilt as rows and validated by
  the row schema, so a 422 carries the same message as the row form
  (``groups[1].samples[3].loss_mask: ...``). Column-only faults (a byte length, an offset, a
  ``has_logprobs`` other than 0/1, non-zero logprobs where has_logprobs is 0) name the column.
- ``encode`` (rows -> columns) never coerces: a value the columns cannot carry exactly (a float
  token id, a bool reward, an unknown field, ...) raises ``NotColumnar`` so the caller sends rows
  and the receiver's row schema names the problem.
- ``Columns.group_blobs`` cuts validated groups into one-group column blobs (what the buffer
  stores); ``shared.column_blobs`` puts them back together for a lease answer (also from the
  msgpack row blobs the buffer stored before, so a store holds either kind). Nothing here imports
  a service.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgpack
import numpy as np
from pydantic import ValidationError

from headrace.shared import wire
from headrace.shared.schemas import MAX_GROUP_SIZE, Group, Sample, SampleStatus, plain_json

COLUMNS = "application/x-headrace-columns"
FORMAT = "headrace-columns/1"
BLOB_MAGIC = b"\xc1HC1"  # 0xc1 is never a msgpack first byte: a stored blob is columns or a row map

# name -> little-endian dtype of the bin columns; every other column is a list
GROUP_BINS = {"sample_offsets": "<i8"}
SAMPLE_BINS = {"group_index": "<i4", "weight_version": "<i8", "reward": "<f8", "token_offsets": "<i8",
               "tokens": "<i4", "response_length": "<i4", "loss_mask": "u1", "has_logprobs": "u1",
               "rollout_logprobs": "<f4"}
GROUP_LISTS = ("group_id", "metadata")
SAMPLE_LISTS = ("uid", "status", "prompt", "response", "label", "metadata")
_STATUSES = frozenset(s.value for s in SampleStatus)
_FAILED = SampleStatus.failed.value   # an enum's .value is a slow property: read it once
_SAMPLE_KEYS = frozenset(Sample.model_fields)
_GROUP_KEYS = frozenset(Group.model_fields)


class NotColumnar(ValueError):
    """Rows holding a value the columns cannot carry exactly: send them as rows instead."""


def is_columns(content_type: str | None) -> bool:
    """Whether a Content-Type or Accept header value names the columnar format."""
    return bool(content_type) and COLUMNS in content_type.lower()  # type: ignore[operator]


@dataclass
class Columns:
    """Decoded columns (numpy arrays are read-only views of the body where possible)."""

    group_id: list
    group_metadata: list
    sample_offsets: np.ndarray   # int64 [G+1]
    uid: list
    group_index: np.ndarray      # int32 [S]
    status: list
    weight_version: np.ndarray   # int64 [S]
    reward: np.ndarray           # float64 [S], NaN = null
    token_offsets: np.ndarray    # int64 [S+1]
    tokens: np.ndarray           # int32 [T]
    response_length: np.ndarray  # int32 [S]
    loss_mask: np.ndarray        # uint8 [R]
    has_logprobs: np.ndarray     # uint8 [S]
    rollout_logprobs: np.ndarray  # float32 [R]
    prompt: list
    response: list
    label: list
    metadata: list

    @property
    def num_groups(self) -> int:
        return len(self.group_id)

    def response_offsets(self) -> np.ndarray:
        out = np.zeros(len(self.uid) + 1, dtype=np.int64)
        np.cumsum(self.response_length, out=out[1:])
        return out

    # ---- out ---------------------------------------------------------------------------------

    def to_map(self) -> dict[str, Any]:
        groups: dict[str, Any] = {"group_id": self.group_id, "metadata": self.group_metadata,
                                  "sample_offsets": bin_view(self.sample_offsets, "<i8")}
        samples: dict[str, Any] = {k: bin_view(getattr(self, k), dt) for k, dt in SAMPLE_BINS.items()}
        for k in SAMPLE_LISTS:
            samples[k] = getattr(self, k)
        return {"format": FORMAT, "groups": groups, "samples": samples}

    def pack(self, extra: dict[str, Any] | None = None) -> bytes:
        """The body: the columns map, plus ``extra`` top-level keys (a lease's id and deadline)."""
        return msgpack.packb({**self.to_map(), **(extra or {})}, use_bin_type=True)

    def group_blobs(self) -> list[bytes]:
        """Each group alone, as the buffer stores it (``BLOB_MAGIC`` + a one-group body)."""
        ro = self.response_offsets()
        return [self._group_blob(g, ro) for g in range(self.num_groups)]

    def _group_blob(self, g: int, ro: np.ndarray) -> bytes:
        s0, s1 = int(self.sample_offsets[g]), int(self.sample_offsets[g + 1])
        t0, t1 = int(self.token_offsets[s0]), int(self.token_offsets[s1])
        r0, r1 = int(ro[s0]), int(ro[s1])
        part = Columns([self.group_id[g]], [self.group_metadata[g]], np.array([0, s1 - s0], dtype=np.int64),
                       self.uid[s0:s1], self.group_index[s0:s1], self.status[s0:s1], self.weight_version[s0:s1],
                       self.reward[s0:s1], self.token_offsets[s0:s1 + 1] - t0, self.tokens[t0:t1],
                       self.response_length[s0:s1], self.loss_mask[r0:r1], self.has_logprobs[s0:s1],
                       self.rollout_logprobs[r0:r1], self.prompt[s0:s1], self.response[s0:s1],
                       self.label[s0:s1], self.metadata[s0:s1])
        return BLOB_MAGIC + part.pack()

    def group_versions(self) -> list[int]:
        """Each group's weight_version (the minimum over its samples)."""
        return np.minimum.reduceat(self.weight_version, self.sample_offsets[:-1]).tolist() if self.uid else []

    def group_uids(self, g: int) -> tuple[str, ...]:
        return tuple(self.uid[int(self.sample_offsets[g]):int(self.sample_offsets[g + 1])])

    def to_rows(self, groups: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """Groups as row dicts (the shape of ``Group.model_dump``); numbers as Python numbers.

        The cyclic GC is paused meanwhile: a lease of 64 x 8 x 2,048 tokens makes ~2.5M objects,
        and the collections they trigger (each walking the big lists) took ~40% of the time."""
        was = gc.isenabled()
        gc.disable()
        try:
            return self._to_rows(groups)
        finally:
            if was:
                gc.enable()

    def _to_rows(self, groups: Iterable[int] | None) -> list[dict[str, Any]]:
        ro = self.response_offsets().tolist()
        to = self.token_offsets.tolist()
        so = self.sample_offsets.tolist()
        tokens, mask, lp = self.tokens.tolist(), list(self.loss_mask.tobytes()), self.rollout_logprobs.tolist()
        gi, wv, rl, hl = (self.group_index.tolist(), self.weight_version.tolist(), self.response_length.tolist(),
                          self.has_logprobs.tolist())
        rewards = [None if math.isnan(r) else r for r in self.reward.tolist()]
        out = []
        for g in (range(self.num_groups) if groups is None else groups):
            gid = self.group_id[g]
            samples = [{"uid": self.uid[j], "group_id": gid, "index": gi[j], "tokens": tokens[to[j]:to[j + 1]],
                        "response_length": rl[j], "loss_mask": mask[ro[j]:ro[j + 1]],
                        "rollout_logprobs": lp[ro[j]:ro[j + 1]] if hl[j] else None, "reward": rewards[j],
                        "status": self.status[j], "weight_version": wv[j], "prompt": self.prompt[j],
                        "response": self.response[j], "label": self.label[j], "metadata": self.metadata[j]}
                       for j in range(so[g], so[g + 1])]
            out.append({"group_id": gid, "samples": samples, "metadata": self.group_metadata[g]})
        return out

    def to_groups(self) -> list[Group]:
        """Validated columns as ``Group`` models, built without validating again (``model_construct``)."""
        rows = self.to_rows()
        was = gc.isenabled()
        gc.disable()
        try:
            return [Group.model_construct(group_id=r["group_id"], metadata=r["metadata"],
                                          samples=[Sample.model_construct(**s) for s in r["samples"]]) for r in rows]
        finally:
            if was:
                gc.enable()


def bin_view(a: np.ndarray, dtype: str) -> memoryview:
    return memoryview(np.ascontiguousarray(a, dtype=dtype)).cast("B")  # msgpack writes it as bin, no copy


# ---- rows -> columns ---------------------------------------------------------------------------


def _field(s: Any, name: str, default: Any) -> Any:
    return getattr(s, name, default) if not isinstance(s, dict) else s.get(name, default)


def _ints(values: list, dtype: str, what: str) -> np.ndarray:
    if not values:
        return np.zeros(0, dtype=dtype)
    if any(type(v) is bool for v in values[:1]):
        raise NotColumnar(f"{what}: booleans")
    try:
        a = np.array(values)
    except (ValueError, TypeError, OverflowError) as e:
        raise NotColumnar(f"{what}: {e}") from None
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise NotColumnar(f"{what}: not integers")
    info = np.iinfo(dtype)
    if a.min() < info.min or a.max() > info.max:
        raise NotColumnar(f"{what}: outside {dtype}")
    return a.astype(dtype)


def encode(groups: Sequence[Group | dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
    """``groups`` (models or row dicts) as a columnar body; ``NotColumnar`` when rows must be sent."""
    cols = from_rows(groups)
    try:
        return cols.pack(extra)
    except (TypeError, ValueError, OverflowError) as e:  # a free-form value msgpack cannot write
        raise NotColumnar(str(e)) from None


def from_rows(groups: Sequence[Group | dict[str, Any]]) -> Columns:
    """Rows to columns, exactly (see ``NotColumnar``); invariants are left to the receiver."""
    gids, gmeta, soff = [], [], [0]
    uid, gi, status, wv, reward, toff, rl, hl, prompt, response, label, meta = ([] for _ in range(12))
    toks: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    toff.append(0)
    for g in groups:
        if isinstance(g, dict) and not set(g) <= _GROUP_KEYS:
            raise NotColumnar("unknown group field")
        gid = _field(g, "group_id", None)
        samples = _field(g, "samples", None)
        if not isinstance(gid, str) or not isinstance(samples, (list, tuple)):
            raise NotColumnar("group_id / samples")
        gids.append(gid)
        gmeta.append(_field(g, "metadata", {}))
        for s in samples:
            if isinstance(s, dict) and not set(s) <= _SAMPLE_KEYS:
                raise NotColumnar("unknown sample field")
            if _field(s, "group_id", None) != gid:
                raise NotColumnar("sample of another group")
            t = _field(s, "tokens", None)
            m = _field(s, "loss_mask", [])
            lp = _field(s, "rollout_logprobs", None)
            r = _field(s, "reward", None)
            st = _field(s, "status", SampleStatus.completed.value)
            st = st.value if isinstance(st, SampleStatus) else st
            if not isinstance(t, list) or not isinstance(m, list) or not (lp is None or isinstance(lp, list)):
                raise NotColumnar("tokens / loss_mask / rollout_logprobs")
            if not (r is None or (isinstance(r, (int, float)) and type(r) is not bool and math.isfinite(r))) \
                    or not isinstance(st, str):
                raise NotColumnar("reward / status")
            n = _field(s, "response_length", 0)
            if type(n) is not int or len(m) != n or (lp is not None and len(lp) != n):
                raise NotColumnar("response_length")
            uid.append(_field(s, "uid", None))
            gi.append(_field(s, "index", 0))
            status.append(st)
            wv.append(_field(s, "weight_version", 0))
            reward.append(math.nan if r is None else float(r))
            toks.extend(t)
            toff.append(len(toks))
            rl.append(n)
            mask.extend(m)
            hl.append(lp is not None)
            lps.extend(lp if lp is not None else (0.0,) * n)
            prompt.append(_field(s, "prompt", None))
            response.append(_field(s, "response", None))
            label.append(_field(s, "label", None))
            meta.append(_field(s, "metadata", {}))
        soff.append(len(uid))
    lp_arr = np.array(lps, dtype=np.float64) if lps else np.zeros(0)
    with np.errstate(invalid="ignore", over="ignore"):
        lp32 = lp_arr.astype(np.float32)
        if lp_arr.size and (((lp_arr > 0) & (lp32 <= 0)) | (np.isfinite(lp_arr) & ~np.isfinite(lp32))).any():
            raise NotColumnar("rollout_logprobs: float32 would turn it valid or infinite")
    if any(type(x) is not int for x in (*gi, *wv)):
        raise NotColumnar("index / weight_version")
    return Columns(gids, gmeta, np.array(soff, dtype=np.int64), uid, _ints(gi, "<i4", "index"), status,
                   _ints(wv, "<i8", "weight_version"), np.array(reward, dtype=np.float64),
                   np.array(toff, dtype=np.int64), _ints(toks, "<i4", "tokens"), _ints(rl, "<i4", "response_length"),
                   _ints(mask, "u1", "loss_mask"), np.array(hl, dtype=np.uint8), lp32,
                   prompt, response, label, meta)


# ---- bytes -> validated columns ----------------------------------------------------------------


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def _err(message: str, groups: int = 1) -> wire.WireError:
    e = wire.WireError(message)
    e.groups = max(1, groups)  # type: ignore[attr-defined]
    return e


def _section(top: dict, name: str, bins: dict[str, str], lists: Sequence[str]) -> dict[str, Any]:
    sec = top.get(name)
    if not isinstance(sec, dict):
        raise _err(f"{name}: must be a map of columns")
    unknown = sorted(set(sec) - set(bins) - set(lists), key=str)
    if unknown:
        raise _err(f"{name}.{str(unknown[0])[:40]}: unknown column")
    out: dict[str, Any] = {}
    for k, dt in bins.items():
        v = sec.get(k)
        if not isinstance(v, bytes):
            raise _err(f"{name}.{k}: " + ("missing column" if k not in sec else f"must be bin ({dt}), not "
                                          f"{type(v).__name__}"))
        size = np.dtype(dt).itemsize
        if len(v) % size:
            raise _err(f"{name}.{k}: byte length {len(v)} is not a multiple of the item size {size} ({dt})")
        out[k] = np.frombuffer(v, dtype=dt)
    for k in lists:
        v = sec.get(k)
        if not isinstance(v, list):
            raise _err(f"{name}.{k}: " + ("missing column" if k not in sec else f"must be a list, not {type(v).__name__}"))
        out[k] = v
    return out


def _offsets(name: str, a: np.ndarray, n: int, total: int, what: str) -> None:
    if len(a) != n + 1:
        raise _err(f"{name}: {len(a)} offsets for {n} {what} (need {n + 1})")
    if a[0] != 0 or (n and (np.diff(a) < 0).any()) or a[-1] != total:
        raise _err(f"{name}: offsets must start at 0, never decrease and end at {total} (the column's length)")


def decode(body: bytes, extra_keys: Sequence[str] = ()) -> tuple[Columns, dict[str, Any]]:
    """Decode and validate a columnar body: ``(columns, the top-level extra_keys found)``; a
    ``WireError`` (422, carrying the group count in ``.groups``) naming the problem otherwise."""
    if not body:
        raise _err("empty request body")
    try:
        top = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception as e:  # msgpack raises several unrelated types
        raise _err(f"malformed columns body: {type(e).__name__}: {e}") from None
    if not isinstance(top, dict):
        raise _err("columns body must be a map")
    if top.get("format") != FORMAT:
        raise _err(f"format: must be {FORMAT!r}" + ("" if "format" in top else " (missing)"))
    unknown = sorted(set(top) - {"format", "groups", "samples", *extra_keys}, key=str)
    if unknown:
        raise _err(f"{str(unknown[0])[:40]}: unknown field")
    try:
        gs = _section(top, "groups", GROUP_BINS, GROUP_LISTS)
        ss = _section(top, "samples", SAMPLE_BINS, SAMPLE_LISTS)
        cols = Columns(gs["group_id"], gs["metadata"], gs["sample_offsets"],
                       **{k: ss[k] for k in (*SAMPLE_BINS, *SAMPLE_LISTS)})
        validate(cols)
    except wire.WireError as e:  # the rejected counter counts the groups the body held
        ids = top.get("groups", {}).get("group_id") if isinstance(top.get("groups"), dict) else None
        e.groups = max(1, len(ids)) if isinstance(ids, list) else 1  # type: ignore[attr-defined]
        raise
    return cols, {k: top[k] for k in extra_keys if k in top}


def validate(cols: Columns) -> None:
    """Every invariant of the row schema, vectorised; ``WireError`` with the row form's message."""
    G = len(cols.group_id)
    if G == 0:
        raise _err("groups: List should have at least 1 item after validation, not 0")
    if len(cols.group_metadata) != G:
        raise _err(f"groups.metadata: {len(cols.group_metadata)} entries for {G} groups", G)
    S = int(cols.sample_offsets[-1]) if len(cols.sample_offsets) == G + 1 else len(cols.uid)
    _offsets("groups.sample_offsets", cols.sample_offsets, G, S, "groups")
    for k in ("uid", "group_index", "status", "weight_version", "reward", "response_length", "has_logprobs",
              "prompt", "response", "label", "metadata"):
        if len(getattr(cols, k)) != S:
            raise _err(f"samples.{k}: {len(getattr(cols, k))} entries for {S} samples", G)
    _offsets("samples.token_offsets", cols.token_offsets, S, len(cols.tokens), "samples")
    rl = cols.response_length
    bad = np.zeros(S, dtype=bool)
    lengths = np.diff(cols.token_offsets)
    bad |= (rl < 0) | (rl > lengths)
    if not bad.any():
        R = int(rl.sum(dtype=np.int64))
        for k in ("loss_mask", "rollout_logprobs"):
            if len(getattr(cols, k)) != R:
                raise _err(f"samples.{k}: {len(getattr(cols, k))} entries, but the response lengths sum to {R}", G)
        ro = cols.response_offsets()
        bad[_owners(cols.token_offsets, cols.tokens < 0)] = True
        bad[_owners(ro, cols.loss_mask > 1)] = True
        lp = cols.rollout_logprobs
        with np.errstate(invalid="ignore"):
            lp_bad = ~np.isfinite(lp) | (lp > 0)
        has = cols.has_logprobs.astype(bool)
        column_only = cols.has_logprobs > 1
        if has.all():  # the common case: no per-token repeat of the flags
            bad[_owners(ro, lp_bad)] = True
        else:
            has_r = np.repeat(has, rl)
            bad[_owners(ro, lp_bad & has_r)] = True
            column_only[_owners(ro, (lp != 0) & ~has_r)] = True
    else:
        column_only = np.zeros(S, dtype=bool)
    failed = np.array([st == _FAILED for st in cols.status], dtype=bool)
    with np.errstate(invalid="ignore"):
        bad |= np.isinf(cols.reward) | (np.isnan(cols.reward) & ~failed)
    bad |= (cols.group_index < 0) | (cols.weight_version < 0)
    for j, plain in enumerate(_plain_samples(cols)):
        if not plain:
            bad[j] = True
    sizes = np.diff(cols.sample_offsets)
    group_of = np.repeat(np.arange(G), sizes)
    bad_groups = set(group_of[bad | column_only].tolist()) | set(np.flatnonzero((sizes < 1) | (sizes > MAX_GROUP_SIZE)).tolist())
    # an index repeated within a group: equal neighbours once sorted by (group, index)
    order = np.lexsort((cols.group_index, group_of))
    repeated = (np.diff(group_of[order]) == 0) & (np.diff(cols.group_index[order]) == 0)
    bad_groups.update(group_of[order][1:][repeated].tolist())
    offsets = cols.sample_offsets.tolist()
    for g in range(G):
        gid = cols.group_id[g]
        if not (isinstance(gid, str) and 1 <= len(gid) <= 512 and isinstance(cols.group_metadata[g], dict)):
            bad_groups.add(g)
        s0, s1 = offsets[g], offsets[g + 1]
        if len(set(cols.uid[s0:s1])) != s1 - s0:
            bad_groups.add(g)
    if not bad_groups:
        return
    g = min(bad_groups)
    raise _err(_row_message(cols, g, column_only), G)


def _owners(offsets: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """The samples owning the flagged items of a flat column cut by ``offsets``."""
    hits = np.flatnonzero(flags)
    return np.searchsorted(offsets, hits, side="right") - 1 if hits.size else hits


def _plain_samples(cols: Columns) -> list[bool]:
    """Whether each sample's per-sample values are what the row schema takes: uid, status, prompt,
    response, and plain-JSON label and metadata (scalars and flat maps of scalars pass without the
    walk of ``plain_json``)."""
    out = []
    for u, st, p, r, label, meta in zip(cols.uid, cols.status, cols.prompt, cols.response, cols.label, cols.metadata):
        if not (isinstance(u, str) and 1 <= len(u) <= 512 and st in _STATUSES and (p is None or isinstance(p, str))
                and (r is None or isinstance(r, str)) and isinstance(meta, dict)):
            out.append(False)
        elif _scalar(label) and all(type(k) is str and _scalar(v) for k, v in meta.items()):
            out.append(True)
        else:
            try:
                plain_json(label)
                plain_json(meta)
                out.append(True)
            except ValueError:
                out.append(False)
    return out


def _scalar(v: Any) -> bool:
    """A JSON scalar the row schema takes as it is (an int within the signed 64-bit range)."""
    t = type(v)
    return v is None or t is str or t is float or t is bool or (t is int and -(2**63) <= v < 2**63)


def _row_message(cols: Columns, g: int, column_only: np.ndarray) -> str:
    """The row schema's message for group ``g`` (its samples rebuilt as rows), or the column's."""
    s0, s1 = int(cols.sample_offsets[g]), int(cols.sample_offsets[g + 1])
    for j in range(s0, s1):
        if column_only[j]:
            what = ("has_logprobs: must be 0 or 1" if cols.has_logprobs[j] > 1 else
                    "rollout_logprobs: has_logprobs is 0 but its slice holds non-zero values")
            return f"groups[{g}].samples[{j - s0}].{what}"
    try:
        Group.model_validate(cols.to_rows([g])[0])
    except ValidationError as e:
        return wire.format_validation_error(e, prefix=("groups", g))
    return f"groups[{g}]: invalid group"  # a vectorised check the row schema does not share (never expected)
