"""HF safetensors -> TP shards -> HF export: bit-identical, loadable, and clear errors on bad input.

Real gloo processes via ``trainer.launch.spawn``. Models: a perturbed tied Qwen2 preset, the
odd-sized Llama (padding of heads/MLP/vocab at TP=2, all biases, untied) and a bf16 copy of the
Llama preset (loaded in fp32, exported back as bf16).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.support import odd_llama, preset_model


def rank_round_trip(tp: int, jobs: list[tuple[str, str]], broken: dict[str, str]) -> dict[str, str]:
    """Load and export every (source, out) pair; then try each broken dir and return its error."""
    from headrace.trainer.hf_io import save_hf
    from headrace.trainer.model import load_model
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp)
    for src, out in jobs:
        save_hf(load_model(src, info), out, src)
    errors = {}
    for label, d in broken.items():
        try:
            load_model(d, info)
        except (FileNotFoundError, KeyError, ValueError) as e:
            errors[label] = f"{type(e).__name__}: {e}"
    destroy_distributed()
    return errors


def _bf16_copy(src: Path, out: Path) -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    sd = load_file(str(out / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _broken_dirs(src: Path, root: Path) -> dict[str, Path]:
    """Copies of ``src`` with a tensor removed, a tensor of the wrong shape, and no weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = {}
    for label in ("missing", "shape", "noweights"):
        d = root / label
        shutil.copytree(src, d)
        sd = load_file(str(d / "model.safetensors"))
        if label == "missing":
            del sd["model.layers.1.mlp.down_proj.weight"]
        elif label == "shape":
            sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
        if label == "noweights":
            (d / "model.safetensors").unlink()
        else:
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[label] = d
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hfio")
    llama = preset_model("tiny-llama", root / "tiny-llama", seed=5)
    return {"tiny-qwen2": preset_model("tiny-qwen2", root / "tiny-qwen2", seed=6),
            "odd-llama": odd_llama(root / "odd-llama", seed=3),
            "bf16-llama": _bf16_copy(llama, root / "bf16-llama")}


def _assert_identical(src: Path, out: Path) -> None:
    import torch
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as a, \
            safe_open(str(out / "model.safetensors"), framework="pt") as b:
        assert set(a.keys()) == set(b.keys()), set(a.keys()) ^ set(b.keys())
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), f"{k} differs"
    for f in src.iterdir():
        if f.name != "model.safetensors":
            assert (out / f.name).read_bytes() == f.read_bytes(), f"{f.name} not copied"


def _assert_loads_in_transformers(src: Path, out: Path) -> None:
    """The exported directory (model + copied config/tokenizer) is a working HF model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([[3, 17, 42, 8]])
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("1+2=3")).replace(" ", "") == "1+2=3"
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_identical(sources: dict[str, Path], tmp_path: Path, tp: int) -> None:
    from headrace.trainer.launch import spawn

    jobs = [(str(src), str(tmp_path / name)) for name, src in sources.items()]
    broken = {k: str(v) for k, v in _broken_dirs(sources["tiny-qwen2"], tmp_path / "broken").items()} if tp == 2 else {}
    errors = spawn(rank_round_trip, tp, tp, jobs, broken, timeout_s=600)
    for name, src in sources.items():
        _assert_identical(src, tmp_path / name)
    assert not list(tmp_path.glob("*/model.safetensors.tmp"))
    if tp == 2:
        _assert_loads_in_transformers(sources["tiny-qwen2"], tmp_path / "tiny-qwen2")
        for rank_errors in errors:
            assert "KeyError" in rank_errors["missing"] and "model.layers.1.mlp.down_proj.weight" in rank_errors["missing"]
            assert "model.layers.0.self_attn.k_proj.weight" in rank_errors["shape"] and "(3, 3)" in rank_errors["shape"]
            assert "FileNotFoundError" in rank_errors["noweights"]


def rank_export_after_update(src: str, out: str) -> Any:
    """Change every weight (as training would), export; return the TP-gathered tensors."""
    import torch

    from headrace.trainer.hf_io import save_hf
    from headrace.trainer.model import load_model
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(2)
    model = load_model(src, info)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    save_hf(model, out, src)
    destroy_distributed()
    return info.tp_rank


def test_export_reflects_updated_weights_and_keeps_padding_out(sources: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from headrace.trainer.launch import spawn

    src = sources["odd-llama"]
    spawn(rank_export_after_update, 2, str(src), str(tmp_path / "out"))
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    for k in a:
        # padded heads / MLP units / vocab rows also got +0.5 on the ranks; export must drop them
        assert b[k].shape == a[k].shape, k
        assert torch.allclose(b[k], a[k] + 0.5, atol=1e-6), k
