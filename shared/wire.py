"""Body encoding shared by every Headrace HTTP service and client: JSON (orjson) or msgpack.

Guarantees:
- ``decode_body`` turns raw request bytes into Python objects with orjson or msgpack, chosen by
  the Content-Type (``application/msgpack`` / ``application/x-msgpack``; anything else is JSON),
  and raises ``WireError`` (status 422, a message saying what is malformed) instead of any
  parser exception. It never evaluates anything: msgpack extension types are refused (the
  Timestamp extension, which msgpack decodes by itself, is refused by the schemas' field types).
- ``check_content_type``: a declared Content-Type other than JSON or msgpack is a 415.
- ``encode`` answers in msgpack when the Accept header asks for it, JSON otherwise. Bytes values
  (msgpack ``bin``) are written to JSON as UTF-8 text.
- ``format_validation_error`` renders a pydantic error as ``groups[3].samples[1].loss_mask: ...``
  so a 422 names the group index and the field.

Nothing here imports a service; starlette is imported only by ``respond``.
"""

from __future__ import annotations

from typing import Any, Mapping

import msgpack
import orjson
from pydantic import ValidationError

JSON = "application/json"
MSGPACK = "application/msgpack"
_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


class WireError(ValueError):
    """A request body that cannot be decoded or validated; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def is_msgpack(content_type: str | None) -> bool:
    """Whether a Content-Type or Accept header value names msgpack."""
    if not content_type:
        return False
    ct = content_type.lower()
    return any(t in ct for t in _MSGPACK_TYPES)


def check_content_type(content_type: str | None) -> None:
    """``WireError`` 415 unless the Content-Type is JSON, msgpack or absent (absent reads as JSON)."""
    if not content_type or is_msgpack(content_type):
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == JSON or (media.startswith("application/") and media.endswith("+json")):
        return
    raise WireError(f"unsupported Content-Type {content_type[:80]!r}: send {JSON} or {MSGPACK}", 415)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def decode_body(body: bytes, content_type: str | None) -> Any:
    """Parse a raw body; ``WireError`` (422) when it is empty or malformed."""
    if not body:
        raise WireError("empty request body")
    if is_msgpack(content_type):
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext)
        except Exception as e:  # msgpack raises several unrelated types (ExtraData, ValueError, ...)
            raise WireError(f"malformed msgpack body: {type(e).__name__}: {e}") from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise WireError(f"malformed JSON body: {e}") from None


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).decode("utf-8", errors="replace")
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _msgpack_default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    raise TypeError(f"{type(obj).__name__} is not msgpack serializable")


def dumps_json(obj: Any) -> bytes:
    return orjson.dumps(obj, default=_json_default)


def dumps_msgpack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_msgpack_default)


def encode(obj: Any, accept: str | None) -> tuple[bytes, str]:
    """``(body, media_type)``: msgpack if ``accept`` asks for it, else JSON."""
    if is_msgpack(accept):
        return dumps_msgpack(obj), MSGPACK
    return dumps_json(obj), JSON


def encode_request(obj: Any, use_msgpack: bool) -> tuple[bytes, str]:
    """Body and Content-Type for a client request."""
    return (dumps_msgpack(obj), MSGPACK) if use_msgpack else (dumps_json(obj), JSON)


def decode_answer(body: bytes, content_type: str | None) -> Any:
    """Parse an answer body (the inverse of ``encode``)."""
    return decode_body(body, content_type) if body else None


def respond(obj: Any, accept: str | None, status: int = 200, headers: Mapping[str, str] | None = None) -> Any:
    """A starlette ``Response`` with ``obj`` encoded per the Accept header."""
    from starlette.responses import Response

    body, media_type = encode(obj, accept)
    return Response(content=body, status_code=status, media_type=media_type, headers=dict(headers or {}))


def loc_to_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """``("groups", 3, "samples", 1, "loss_mask")`` -> ``groups[3].samples[1].loss_mask``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<body>"


def format_validation_error(e: ValidationError, max_errors: int = 5, prefix: tuple[Any, ...] = ()) -> str:
    """One line per error (at most ``max_errors``), each starting with the field path (after ``prefix``)."""
    errors = e.errors(include_url=False, include_input=False)
    lines = []
    for err in errors[:max_errors]:
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{loc_to_path((*prefix, *err['loc']))}: {msg}")
    if len(errors) > max_errors:
        lines.append(f"... and {len(errors) - max_errors} more errors")
    return "; ".join(lines)
