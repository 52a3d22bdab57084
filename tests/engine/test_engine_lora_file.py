"""The reference engine's reading of ``adapter_model.safetensors`` (``rollout.engine.lora``), in
process on the tiny model: an adapter written by ``safetensors`` itself with mixed dtypes gives the
same delta as in fp32, and every malformed file is one ``AdapterError`` (400) naming what is wrong,
before anything is loaded. The HTTP side of these errors is tested in test_engine_lora.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

LAYER = "base_model.model.model.layers.{i}.{kind}.{proj}.lora_{ab}.weight"


@pytest.fixture(scope="module")
def setup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from headrace.rollout.engine.confine import WeightDirs
    from headrace.rollout.engine.model import DecoderModel

    root = tmp_path_factory.mktemp("lora-files")
    model = DecoderModel.from_pretrained(tiny_model)
    return {"model": model, "root": root, "dirs": WeightDirs(tiny_model, [root]), "base": str(tiny_model)}


def adapter(setup: dict[str, Any], name: str, dtypes: dict[str, torch.dtype] | None = None) -> tuple[Path, dict]:
    """A rank-2 adapter on q_proj and down_proj of every layer, written by ``safetensors.save_file``."""
    from safetensors.torch import save_file

    m, d = setup["model"], setup["root"] / name
    a = m.arch
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(a.num_layers):
        for kind, proj, fan_in, out in (("self_attn", "q_proj", a.hidden_size, m.q_size),
                                        ("mlp", "down_proj", a.intermediate_size, a.hidden_size)):
            for ab, shape in (("A", (2, fan_in)), ("B", (out, 2))):
                t = torch.randn(shape, generator=g) * 0.1
                tensors[LAYER.format(i=i, kind=kind, proj=proj, ab=ab)] = t.to((dtypes or {}).get(ab, torch.float32))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 3.0, "target_modules": ["q_proj", "down_proj"],
        "base_model_name_or_path": setup["base"]}))
    return d, tensors


def read(setup: dict[str, Any], d: Path) -> Any:
    from headrace.rollout.engine.lora import read_adapter

    return read_adapter("x", str(d), setup["model"], [setup["base"]], setup["dirs"])


def delta(setup: dict[str, Any], ad: Any) -> list[torch.Tensor]:
    from headrace.rollout.engine.lora import LoraBatch

    m = setup["model"]
    x = torch.randn(2, 3, m.arch.hidden_size, generator=torch.Generator().manual_seed(1))
    xi = torch.randn(2, 3, m.arch.intermediate_size, generator=torch.Generator().manual_seed(2))
    qkv = LoraBatch([ad, None]).add(torch.zeros(2, 3, m.q_size + 2 * m.kv_size), x, "0.qkv")
    down = LoraBatch([ad, ad]).add(torch.zeros(2, 3, m.arch.hidden_size), xi, "1.down")
    return [qkv, down]


def test_mixed_dtypes_read_as_their_values(setup: dict[str, Any]) -> None:
    d32, t32 = adapter(setup, "f32")
    dmix, tmix = adapter(setup, "mixed", {"B": torch.bfloat16})
    got32, gotmix = delta(setup, read(setup, d32)), delta(setup, read(setup, dmix))
    # the reference: scale * x A^T B^T with the file's values, in fp64
    m = setup["model"]
    x = torch.randn(2, 3, m.arch.hidden_size, generator=torch.Generator().manual_seed(1)).double()
    for got, t in ((got32, t32), (gotmix, tmix)):
        A, B = (t[LAYER.format(i=0, kind="self_attn", proj="q_proj", ab=ab)].double() for ab in "AB")
        want = 1.5 * (x[0] @ A.T @ B.T)
        assert torch.allclose(got[0][0, :, :m.q_size].double(), want, atol=1e-5)
        assert torch.equal(got[0][1], torch.zeros_like(got[0][1])), "a row without the adapter got a delta"
        assert got[1].abs().sum() > 0


def test_a_repeated_layout_reads_each_files_values(setup: dict[str, Any]) -> None:
    """A weight sync loads the same layout every version: the engine checks a header once and
    reuses its plan for byte-identical headers. Two files with one layout and other values each
    give their own delta, the same as on a first read; a truncated file with that header is
    still refused (its length is part of what must match)."""
    from safetensors.torch import save_file

    from headrace.rollout.engine import lora

    d1, _ = adapter(setup, "same-1")
    d2, t2 = adapter(setup, "same-2")
    save_file({k: -2.0 * t if "lora_B" in k else t for k, t in t2.items()}, str(d2 / "adapter_model.safetensors"))
    lora._PLANS.clear()
    first1 = delta(setup, read(setup, d1))             # checked and planned
    (plan,) = lora._PLANS.values()
    got2 = delta(setup, read(setup, d2))               # same header bytes: the plan is reused
    again1 = delta(setup, read(setup, d1))
    assert list(lora._PLANS.values()) == [plan]
    assert all(torch.equal(x, y) for x, y in zip(first1, again1))
    assert all(torch.allclose(y, -2.0 * x, atol=1e-5) for x, y in zip(first1, got2))
    bad = d2 / "adapter_model.safetensors"
    bad.write_bytes(bad.read_bytes()[:-4])
    with pytest.raises(lora.AdapterError, match="truncated or padded"):
        read(setup, d2)


def corrupt(setup: dict[str, Any], name: str, edit: Callable[[bytes], bytes]) -> Path:
    d, _ = adapter(setup, name)
    f = d / "adapter_model.safetensors"
    f.write_bytes(edit(f.read_bytes()))
    return d


def with_header(raw: bytes, fn: Callable[[dict], Any]) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    fn(h)
    hb = json.dumps(h).encode()
    return len(hb).to_bytes(8, "little") + hb + raw[8 + n:]


def first(h: dict) -> str:
    return min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


@pytest.mark.parametrize("case,edit,words", [
    ("truncated", lambda b: b[:-10], "truncated or padded"),
    ("padded", lambda b: b + b"\0" * 8, "truncated or padded"),
    ("tiny", lambda b: b[:5], "not a safetensors file"),
    ("huge-header", lambda b: (1 << 40).to_bytes(8, "little") + b[8:], "not a safetensors file"),
    ("not-json", lambda b: b[:8] + b"{" * int.from_bytes(b[:8], "little") + b[8 + int.from_bytes(b[:8], "little"):],
     "not valid JSON"),
    ("list", lambda b: with_header(b, lambda h: h.update({first(h): [1, 2]})), "is not {dtype, shape"),
    ("dtype", lambda b: with_header(b, lambda h: h[first(h)].update(dtype="F33")), "unknown dtype 'F33'"),
    ("int-dtype", lambda b: with_header(b, lambda h: h[first(h)].update(dtype="I32")), "floating point expected"),
    ("offsets", lambda b: with_header(b, lambda h: h[first(h)].update(
        data_offsets=[h[first(h)]["data_offsets"][0], h[first(h)]["data_offsets"][1] - 4])), "do not fit its shape"),
    ("overlap", lambda b: with_header(b, lambda h: [h[k].update(data_offsets=[o + 4 for o in h[k]["data_offsets"]])
                                                     for k in h if k != "__metadata__"]), "overlap or gap"),
    ("negative", lambda b: with_header(b, lambda h: h[first(h)].update(shape=[-1, 4])), "is not {dtype, shape"),
])
def test_a_malformed_file_is_one_error_naming_it(setup: dict[str, Any], case: str, edit: Any, words: str) -> None:
    from headrace.rollout.engine.lora import AdapterError

    d = corrupt(setup, case, edit)
    with pytest.raises(AdapterError) as e:
        read(setup, d)
    assert words in str(e.value) and e.value.status == 400, str(e.value)
