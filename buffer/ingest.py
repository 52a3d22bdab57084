"""The ingest hot path: raw POST /v1/groups body -> validated ``GroupRow``s, or a ``WireError``.

Guarantees:
- the whole request is validated with the pydantic schemas (``PostGroupsRequest``, strict: see
  ``shared.schemas``) before anything is stored; the first error is reported as
  ``groups[i].samples[j].field: message``; a Content-Type other than JSON / msgpack / columns is 415;
- a columnar body (``application/x-headrace-columns``) is validated by ``shared.columns.decode``
  (numpy, the same invariants and messages) and each group is stored as its own column blob;
- everything accepted can be written back out as JSON and msgpack (the schemas refuse msgpack
  extensions, bytes, non-string keys and deep nesting), so no stored group can fail its lease;
- each stored blob is the msgpack encoding of exactly what the client sent for that group. For a
  msgpack body the blob is sliced from the body itself (no re-encoding); for JSON it is packed
  once. Validation is deterministic, so a blob always re-validates to the same ``Group``.
"""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import ValidationError

from headrace.buffer.store import GroupRow
from headrace.shared import columns, wire
from headrace.shared.schemas import PostGroupsRequest


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def _split_msgpack(body: bytes) -> tuple[Any, list[bytes]] | None:
    """Decode ``{"groups": [...], ...}`` keeping each group's raw bytes; None if not that shape."""
    up = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_no_ext, max_buffer_size=len(body) + 1)
    up.feed(body)
    try:
        n_keys = up.read_map_header()
        obj: dict[str, Any] = {}
        blobs: list[bytes] = []
        for _ in range(n_keys):
            key = up.unpack()
            if not isinstance(key, str) or key in obj:  # a non-string key: the strict decoder names it
                return None  # (a repeated key: the strict decoder keeps the last one; so do we, by re-packing)
            if key == "groups":
                try:
                    n_groups = up.read_array_header()
                except (msgpack.UnpackValueError, ValueError, TypeError):
                    return None
                groups = []
                for _ in range(n_groups):
                    start = up.tell()
                    groups.append(up.unpack())
                    blobs.append(body[start:up.tell()])
                obj[key] = groups
            else:
                obj[key] = up.unpack()
        if up.tell() != len(body):
            return None  # trailing bytes: let the strict decoder report them
    except Exception:
        return None
    return obj, blobs


def group_count(obj: Any) -> int:
    """How many groups a refused body held, for the ``rejected`` counter (1 when unknown)."""
    if isinstance(obj, dict) and isinstance(obj.get("groups"), list):
        return max(1, len(obj["groups"]))
    return 1


def parse_groups(body: bytes, content_type: str | None) -> list[GroupRow]:
    """Decode and validate a POST /v1/groups body. ``WireError`` carries the group count in ``.groups``."""
    blobs: list[bytes] | None = None
    obj: Any = None
    if columns.is_columns(content_type):
        cols, _ = columns.decode(body)
        versions = cols.group_versions()
        return [GroupRow(cols.group_id[g], cols.group_uids(g), versions[g], blob)
                for g, blob in enumerate(cols.group_blobs())]
    try:
        wire.check_content_type(content_type)
    except wire.WireError as e:
        e.message += f" or {columns.COLUMNS}"  # POST /v1/groups takes columns too
        e.groups = 1  # type: ignore[attr-defined]
        raise
    if wire.is_msgpack(content_type):
        split = _split_msgpack(body)
        if split is not None:
            obj, blobs = split
    if obj is None:
        try:
            obj = wire.decode_body(body, content_type)
        except wire.WireError as e:
            e.groups = 1  # type: ignore[attr-defined]
            raise
    try:
        req = PostGroupsRequest.model_validate(obj)
    except ValidationError as e:
        err = wire.WireError(wire.format_validation_error(e))
        err.groups = group_count(obj)  # type: ignore[attr-defined]
        raise err from None
    if blobs is None:
        blobs = [wire.dumps_msgpack(g) for g in obj["groups"]]
    return [GroupRow(g.group_id, tuple(s.uid for s in g.samples), g.weight_version, blob)
            for g, blob in zip(req.groups, blobs)]
