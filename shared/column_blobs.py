"""Stored group blobs and lease answers in the columnar format (DESIGN.md "Columnar wire format and
scale-out"): the buffer stores each group as one blob (``BLOB_MAGIC`` + a one-group columns body,
or, for rows the columns cannot carry exactly, a msgpack row map) and answers a lease from them.

Guarantees:
- ``merge`` and ``pack_merged`` lay the groups end to end in lease order, offsets rebased; a row
  blob is converted (``NotColumnar`` when it cannot be: the caller answers in rows then);
  ``pack_merged(blobs, extra)`` decodes (``columns.decode``) to exactly what
  ``merge(blobs).pack(extra)`` does, with one copy of the binary columns.
- ``blob_rows`` gives one stored blob, of either kind, as the row dict of ``Group.model_dump``.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

from headrace.shared.columns import BLOB_MAGIC, FORMAT, SAMPLE_BINS, SAMPLE_LISTS, Columns, bin_view, from_rows


def _blob_columns(blob: bytes) -> Columns:
    if blob[:4] == BLOB_MAGIC:
        top = msgpack.unpackb(memoryview(blob)[4:], raw=False)
        gs, ss = top["groups"], top["samples"]
        return Columns(gs["group_id"], gs["metadata"], np.frombuffer(gs["sample_offsets"], "<i8"),
                       **{k: (np.frombuffer(ss[k], SAMPLE_BINS[k]) if k in SAMPLE_BINS else ss[k])
                          for k in (*SAMPLE_BINS, *SAMPLE_LISTS)})
    return from_rows([msgpack.unpackb(blob, raw=False)])


def _rebased(parts: Sequence[Columns], name: str) -> np.ndarray:
    """The offsets column ``name`` of ``parts`` laid end to end, each rebased past the ones before."""
    arrays, base = [np.zeros(1, dtype=np.int64)], 0
    for c in parts:
        a = getattr(c, name)
        arrays.append(a[1:] + base)
        base += int(a[-1])
    return np.concatenate(arrays)


def merge(blobs: Sequence[bytes]) -> Columns:
    """One ``Columns`` of stored group blobs (column or row blobs), in order."""
    parts = [_blob_columns(b) for b in blobs]
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> np.ndarray:
        return np.frombuffer(b"".join([memoryview(getattr(p, name)).cast("B") for p in parts]), SAMPLE_BINS[name])

    def offsets(name: str) -> np.ndarray:
        return _rebased(parts, name)

    lists = {k: [x for p in parts for x in getattr(p, k)] for k in ("group_id", "group_metadata", *SAMPLE_LISTS)}
    return Columns(lists["group_id"], lists["group_metadata"], offsets("sample_offsets"), lists["uid"],
                   cat("group_index"), lists["status"], cat("weight_version"), cat("reward"), offsets("token_offsets"),
                   cat("tokens"), cat("response_length"), cat("loss_mask"), cat("has_logprobs"),
                   cat("rollout_logprobs"), lists["prompt"], lists["response"], lists["label"], lists["metadata"])


def _bin_header(n: int) -> bytes:
    """msgpack's header of a bin of ``n`` bytes (bin 8 / 16 / 32)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def pack_merged(blobs: Sequence[bytes], extra: dict[str, Any]) -> bytes:
    """``merge(blobs).pack(extra)`` with one copy of the binary columns: each stored group's bins
    are written straight into the answer after their msgpack bin header (no concatenated column,
    no packer buffer growing through megabytes). Decodes to the same columns and extra keys."""
    parts = [_blob_columns(b) for b in blobs]
    if len(parts) == 1:
        return parts[0].pack(extra)
    p = msgpack.Packer(use_bin_type=True)
    out: list[Any] = []

    def key(k: str) -> None:
        out.append(p.pack(k))

    def rebased(name: str) -> memoryview:
        return bin_view(_rebased(parts, name), "<i8")

    out.append(p.pack_map_header(3 + len(extra)))
    key("format")
    out.append(p.pack(FORMAT))
    key("groups")
    out.append(p.pack_map_header(3))
    key("group_id")
    out.append(p.pack([g for c in parts for g in c.group_id]))
    key("metadata")
    out.append(p.pack([m for c in parts for m in c.group_metadata]))
    key("sample_offsets")
    out.append(p.pack(rebased("sample_offsets")))
    key("samples")
    out.append(p.pack_map_header(len(SAMPLE_BINS) + len(SAMPLE_LISTS)))
    for name, dtype in SAMPLE_BINS.items():
        key(name)
        if name == "token_offsets":
            out.append(p.pack(rebased(name)))
            continue
        pieces = [bin_view(getattr(c, name), dtype) for c in parts]
        out.append(_bin_header(sum(len(x) for x in pieces)))
        out.extend(pieces)
    for name in SAMPLE_LISTS:
        key(name)
        out.append(p.pack([x for c in parts for x in getattr(c, name)]))
    for k, v in extra.items():
        key(k)
        out.append(p.pack(v))
    return b"".join(out)


def blob_rows(blob: bytes) -> dict[str, Any]:
    """A stored blob (column or row) as one row dict."""
    if blob[:4] == BLOB_MAGIC:
        return _blob_columns(blob).to_rows()[0]
    return msgpack.unpackb(blob, raw=False)
