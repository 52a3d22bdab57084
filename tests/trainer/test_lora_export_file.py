"""``trainer.lora_export.save_peft_adapter`` writes its safetensors file itself (straight from the
tensors' memory): the real ``safetensors`` library reads it back bit for bit, in every float dtype,
and a second write replaces the directory whole."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def test_the_file_reads_back_with_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from headrace.trainer.lora_export import save_peft_adapter

    g = torch.Generator().manual_seed(0)
    tensors = {"b.lora_B.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
               "a.lora_A.weight": torch.randn(4, 8, generator=g),
               "c.lora_A.weight": torch.randn(3, 5, generator=g).to(torch.float16),
               "d.lora_A.weight": torch.randn(3, generator=g).double(),
               "e.lora_A.weight": torch.randn(6, 4, generator=g)[:, :3]}      # not contiguous
    cfg = {"rank": 4, "alpha": 8}
    out = save_peft_adapter(tensors, tmp_path / "v1", base_model_path="base", lora_cfg=cfg, durable=False)
    back = load_file(str(out / "adapter_model.safetensors"))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    save_peft_adapter({"x.lora_A.weight": torch.ones(2, 2)}, out, base_model_path="base", lora_cfg=cfg)
    assert list(load_file(str(out / "adapter_model.safetensors"))) == ["x.lora_A.weight"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_a_recycled_directory_is_rewritten_in_place_and_reads_as_new(tmp_path: Path) -> None:
    """``recycle=`` (what a weight sync passes: the version before the previous one) moves that
    directory to the new name and overwrites its file without truncating it first: the file then
    holds exactly what a fresh write holds, a longer old file is cut to the new length, and the
    recycled directory is gone. A missing recycle directory falls back to a fresh write."""
    import os

    from safetensors.torch import load_file

    from headrace.trainer.lora_export import save_peft_adapter

    g = torch.Generator().manual_seed(1)
    cfg = {"rank": 4, "alpha": 8}
    big = {"a.lora_A.weight": torch.randn(4, 64, generator=g), "b.lora_B.weight": torch.randn(64, 4, generator=g)}
    small = {"a.lora_A.weight": torch.randn(4, 8, generator=g), "b.lora_B.weight": torch.randn(8, 4, generator=g)}
    v1 = save_peft_adapter(big, tmp_path / "v1", base_model_path="base", lora_cfg=cfg, durable=False)
    inode = os.stat(v1 / "adapter_model.safetensors").st_ino
    fresh = save_peft_adapter(small, tmp_path / "fresh", base_model_path="base", lora_cfg=cfg, durable=False,
                              recycle=tmp_path / "absent")
    v3 = save_peft_adapter(small, tmp_path / "v3", base_model_path="base", lora_cfg=cfg, durable=False,
                           recycle=v1)
    assert not v1.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "v3"]
    assert os.stat(v3 / "adapter_model.safetensors").st_ino == inode, "the old file was not reused"
    assert (v3 / "adapter_model.safetensors").read_bytes() == (fresh / "adapter_model.safetensors").read_bytes()
    back = load_file(str(v3 / "adapter_model.safetensors"))
    assert all(torch.equal(back[k], t) for k, t in small.items())
    assert (v3 / "adapter_config.json").read_text() == (fresh / "adapter_config.json").read_text()
