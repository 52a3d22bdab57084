"""The columnar codec (shared/columns.py) on its own: round trips, exactness, and every kind of bad
input giving one 422 message that names the group and field (the row form's message where rows
can express the fault). No processes: the buffer's use of it is tested in tests/buffer.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from headrace.shared import columns as C
from headrace.shared import column_blobs as B
from headrace.shared import wire
from headrace.shared.schemas import PostGroupsRequest


def group(gid: str, n: int = 3, prompt: int = 3, response: int = 4, logprobs: bool = True) -> dict[str, Any]:
    return {"group_id": gid, "metadata": {"k": gid}, "samples": [
        {"uid": f"{gid}/{i}", "group_id": gid, "index": i, "tokens": list(range(1 + i, prompt + response + 1 + i)),
         "response_length": response - (i % 2), "loss_mask": [1] * (response - (i % 2) - 1) + [0],
         "rollout_logprobs": [-0.5] * (response - (i % 2)) if logprobs and i != 1 else None,
         "reward": None if i == 2 else float(i), "status": "failed" if i == 2 else "completed",
         "weight_version": 5 - i, "prompt": "p", "response": None, "label": {"answer": [i]},
         "metadata": {"m": i}} for i in range(n)]}


def body_map(groups: list[dict[str, Any]]) -> dict[str, Any]:
    return msgpack.unpackb(C.encode(groups), raw=False)


def decode_map(m: dict[str, Any]) -> C.Columns:
    return C.decode(msgpack.packb(m, use_bin_type=True))[0]


def row_message(groups: list[dict[str, Any]]) -> str:
    try:
        PostGroupsRequest.model_validate({"groups": groups})
    except ValidationError as e:
        return wire.format_validation_error(e)
    raise AssertionError("rows validated")


def test_round_trip_rows_columns_rows() -> None:
    groups = [group("a"), group("b", n=2, logprobs=False), group("c", n=1, response=1)]
    cols, _ = C.decode(C.encode(groups))
    assert cols.num_groups == 3 and cols.group_versions() == [3, 4, 5]
    assert cols.to_rows() == groups  # logprobs -0.5 are exact in float32
    assert PostGroupsRequest.model_validate({"groups": cols.to_rows()})
    # one-group blobs, merged back (with a stored row blob in the middle), give the same rows
    blobs = cols.group_blobs()
    assert all(b[:4] == C.BLOB_MAGIC for b in blobs)
    merged = B.merge([blobs[0], msgpack.packb(groups[1]), blobs[2]])
    assert merged.to_rows() == groups
    again, top = C.decode(merged.pack({"lease_id": "L", "expires_at": 1.5}), ("lease_id", "expires_at"))
    assert top == {"lease_id": "L", "expires_at": 1.5} and again.to_rows() == groups
    assert [g.group_id for g in again.to_groups()] == ["a", "b", "c"]
    # the lease answer written straight from the blobs decodes to the same columns and extra keys
    body = B.pack_merged([blobs[0], msgpack.packb(groups[1]), blobs[2]], {"lease_id": "L", "expires_at": 1.5})
    direct, top = C.decode(body, ("lease_id", "expires_at"))
    assert top == {"lease_id": "L", "expires_at": 1.5} and direct.to_rows() == groups
    assert msgpack.unpackb(body) == msgpack.unpackb(merged.pack({"lease_id": "L", "expires_at": 1.5}))
    one, _ = C.decode(B.pack_merged(blobs[:1], {"lease_id": "L", "expires_at": 1.5}), ("lease_id", "expires_at"))
    assert one.to_rows() == groups[:1]
    assert B.blob_rows(blobs[1]) == groups[1]


@pytest.mark.parametrize("change", [
    lambda g: g["samples"][0].update(tokens=[1.0, 2]),           # a float token id
    lambda g: g["samples"][0].update(reward=True),                # a bool reward
    lambda g: g["samples"][0].update(extra=1),                    # an unknown field
    lambda g: g["samples"][0].update(rollout_logprobs=[1e-60] * 4),  # positive, 0 in float32
    lambda g: g["samples"][0].update(rollout_logprobs=[-1e300] * 4),  # finite, -inf in float32
    lambda g: g["samples"][0].update(loss_mask=[1]),              # length differs from response_length
    lambda g: g["samples"][0].update(group_id="other"),
])
def test_encode_never_coerces(change: Callable[[dict[str, Any]], None]) -> None:
    g = group("x")
    change(g)
    with pytest.raises(C.NotColumnar):
        C.encode([g])


# Faults rows can express: the columns' 422 is the row form's message, word for word.
ROW_FAULTS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("mask 2", lambda g: g["samples"][1]["loss_mask"].__setitem__(0, 2), "groups[1].samples[1].loss_mask"),
    ("positive logprob", lambda g: g["samples"][0]["rollout_logprobs"].__setitem__(2, 0.25),
     "groups[1].samples[0].rollout_logprobs"),
    ("negative token", lambda g: g["samples"][0]["tokens"].__setitem__(0, -3), "groups[1].samples[0].tokens"),
    ("response longer than tokens", lambda g: g["samples"][0].update(
        response_length=9, loss_mask=[1] * 9, rollout_logprobs=[-1.0] * 9), "groups[1].samples[0].response_length"),
    ("null reward, not failed", lambda g: g["samples"][0].update(reward=None), "groups[1].samples[0]"),
    ("repeated index", lambda g: g["samples"][1].update(index=0), "groups[1]"),
    ("repeated uid", lambda g: g["samples"][1].update(uid="y/0"), "groups[1]"),
    ("bad status", lambda g: g["samples"][0].update(status="done"), "groups[1].samples[0].status"),
    ("empty uid", lambda g: g["samples"][0].update(uid=""), "groups[1].samples[0].uid"),
    ("bytes in label", lambda g: g["samples"][0].update(label={"a": b"x"}), "groups[1].samples[0].label"),
    ("negative weight version", lambda g: g["samples"][0].update(weight_version=-1),
     "groups[1].samples[0].weight_version"),
]


@pytest.mark.parametrize("name,change,where", ROW_FAULTS, ids=[f[0] for f in ROW_FAULTS])
def test_value_faults_give_the_row_message(name: str, change: Callable[[dict[str, Any]], None], where: str) -> None:
    groups = [group("x"), group("y")]
    change(groups[1])
    cols = C.from_rows(groups)  # the codec carries the fault; validation must catch it
    with pytest.raises(wire.WireError) as e:
        C.decode(cols.pack())
    assert e.value.status == 422 and e.value.groups == 2
    assert e.value.message == row_message(groups)
    assert e.value.message.startswith(where), e.value.message


def _set_bin(section: str, key: str, fn: Callable[[np.ndarray], np.ndarray], dtype: str) -> Callable[[dict], None]:
    def change(m: dict) -> None:
        m[section][key] = np.ascontiguousarray(fn(np.frombuffer(m[section][key], dtype=dtype).copy()),
                                               dtype=dtype).tobytes()
    return change


def _nan_logprob(a: np.ndarray) -> np.ndarray:
    a[1] = np.nan
    return a


# Faults only columns can have: the message names the column (or the sample and field).
COLUMN_FAULTS: list[tuple[str, Callable[[dict], None], str]] = [
    ("mismatched lengths", lambda m: m["samples"]["uid"].pop(), "samples.uid: 5 entries for 6 samples"),
    ("short weight_version", _set_bin("samples", "weight_version", lambda a: a[:-1], "<i8"),
     "samples.weight_version: 5 entries for 6 samples"),
    ("mask column short", _set_bin("samples", "loss_mask", lambda a: a[:-1], "u1"),
     "samples.loss_mask: 21 entries, but the response lengths sum to 22"),
    ("token offset out of range", _set_bin("samples", "token_offsets", lambda a: a + np.arange(len(a)) * 0 +
                                           (np.arange(len(a)) == len(a) - 1) * 5, "<i8"), "samples.token_offsets"),
    ("token offsets decreasing", _set_bin("samples", "token_offsets", lambda a: a[[0, 2, 1, 3, 4, 5, 6]], "<i8"),
     "samples.token_offsets: offsets must start at 0, never decrease"),
    ("sample offsets not from 0", _set_bin("groups", "sample_offsets", lambda a: a + 1, "<i8"),
     "groups.sample_offsets"),
    ("byte length", lambda m: m["samples"].__setitem__("tokens", m["samples"]["tokens"] + b"\0"),
     "samples.tokens: byte length 169 is not a multiple of the item size 4"),
    ("wrong type", lambda m: m["samples"].__setitem__("reward", [1.0] * 6), "samples.reward: must be bin"),
    ("unknown column", lambda m: m["samples"].__setitem__("advantage", b""), "samples.advantage: unknown column"),
    ("missing column", lambda m: m["samples"].pop("has_logprobs"), "samples.has_logprobs: missing column"),
    ("unknown format", lambda m: m.__setitem__("format", "headrace-columns/2"), "format: must be"),
    ("unknown top-level key", lambda m: m.__setitem__("lease_id", "x"), "lease_id: unknown field"),
    ("has_logprobs 2", _set_bin("samples", "has_logprobs", lambda a: a * 2, "u1"),
     "groups[0].samples[0].has_logprobs: must be 0 or 1"),
    ("logprobs without has_logprobs", _set_bin("samples", "rollout_logprobs", lambda a: a - 1.0, "<f4"),
     "groups[0].samples[1].rollout_logprobs: has_logprobs is 0"),
    ("NaN logprob", _set_bin("samples", "rollout_logprobs", _nan_logprob, "<f4"),
     "groups[0].samples[0].rollout_logprobs[1]: Input should be a finite number"),
    ("empty group", _set_bin("groups", "sample_offsets", lambda a: np.array([0, 0, 6]), "<i8"),
     "groups[0].samples: List should have at least 1 item"),
]


@pytest.mark.parametrize("name,change,message", COLUMN_FAULTS, ids=[f[0] for f in COLUMN_FAULTS])
def test_column_faults_name_the_column(name: str, change: Callable[[dict], None], message: str) -> None:
    m = body_map([group("x"), group("y")])
    change(m)
    with pytest.raises(wire.WireError) as e:
        decode_map(m)
    assert e.value.status == 422 and e.value.message.startswith(message), e.value.message


def test_infinite_reward_and_nan_reward_of_a_failed_sample() -> None:
    m = body_map([group("x")])
    r = np.frombuffer(m["samples"]["reward"], "<f8").copy()
    assert math.isnan(r[2])  # the failed sample's null reward travels as NaN and is accepted
    decode_map(m)
    r[0] = np.inf
    m["samples"]["reward"] = r.tobytes()
    with pytest.raises(wire.WireError, match=r"^groups\[0\]\.samples\[0\]\.reward: Input should be a finite number"):
        decode_map(m)


def test_malformed_bodies() -> None:
    for body, msg in [(b"", "empty request body"), (b"\xc1", "malformed columns body"),
                      (msgpack.packb([1]), "columns body must be a map"),
                      (msgpack.packb({"format": C.FORMAT, "groups": {}, "samples": {}}), "groups.sample_offsets")]:
        with pytest.raises(wire.WireError) as e:
            C.decode(body)
        assert e.value.message.startswith(msg), e.value.message


@pytest.mark.parametrize("n", [0, 255, 256, 65535, 65536, 1 << 20])
def test_bin_headers_are_msgpacks(n: int) -> None:
    data = b"x" * n
    assert B._bin_header(n) + data == msgpack.packb(data, use_bin_type=True)
