"""Helpers the trainer tests share (plain functions, no tests): model builders with every tensor
perturbed, the odd-sized Llama, token sequences and their packed form, and RL groups to train on.

The presets have unit norms and zero biases, which would hide a mis-loaded norm or bias; ``perturb``
makes every tensor count.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml

from headrace.shared.config import load_config
from headrace.shared.schemas import Group, Sample
from tests.procs import Proc, child_env, headrace_cmd

GROUPS_PER_STEP = 4      # of the train-only runs against a real buffer

SEQ_LENS = (7, 1, 12, 5)


# ---- model builders --------------------------------------------------------------------------
def perturb(model_dir: Path, seed: int = 1) -> None:
    """Rewrite model.safetensors with random norms/biases and rescaled matrices (same names/dtypes)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    sd = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            new = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            new = 0.1 * noise
        else:
            new = t.float() * 2.0 + 0.01 * noise
        out[name] = new.to(t.dtype).contiguous()
    save_file(out, str(path), metadata={"format": "pt"})


def preset_model(preset: str, out: Path, seed: int = 0) -> Path:
    """A modelzoo preset with every tensor perturbed."""
    from headrace.shared.modelzoo import init_model

    d = init_model(preset, out, seed=seed)
    perturb(Path(d), seed + 1)
    return Path(d)


def odd_llama(out: Path, seed: int = 0) -> Path:
    """A Llama whose sizes TP=2 does not divide, with attention/MLP biases and llama3 rope."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=75, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, head_dim=8, attention_bias=True,
                      mlp_bias=True, tie_word_embeddings=False, max_position_embeddings=256,
                      rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(out, safe_serialization=True)
    perturb(out, seed + 1)
    return out


def token_seqs(vocab: int, lens: tuple[int, ...] = SEQ_LENS, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]




# ---- batches ---------------------------------------------------------------------------------
def packed(seqs: list[list[int]]) -> tuple[Any, Any, Any, Any, Any]:
    """input_ids, position_ids, cu_seqlens, targets (next token within the sequence) and its mask."""
    import torch

    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist())
    targets = torch.tensor([t for s in seqs for t in s[1:] + [s[0]]])
    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[cu[1:] - 1] = False
    return ids, pos, cu, targets, mask




def make_groups(n_groups: int = 4, size: int = 4, seed: int = 0, vocab: int = 512) -> list[dict]:
    """Groups with varied prompt/response lengths, a failed sample and a tool-masked token."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
        samples = []
        for i in range(size):
            n = rng.randrange(2, 9)
            resp = [rng.randrange(3, vocab) for _ in range(n)]
            failed = g == 1 and i == 3
            mask = [1] * n
            if i == 0:
                mask[0] = 0
            samples.append(Sample(uid=f"s{seed}-{g}-{i}", group_id=f"g{seed}-{g}", index=i, tokens=prompt + resp,
                                  response_length=n, loss_mask=mask,
                                  rollout_logprobs=[-rng.uniform(4.0, 8.0) for _ in range(n)],
                                  reward=None if failed else float(rng.random() < 0.5) + 0.1 * i,
                                  status="failed" if failed else "completed"))
        out.append(Group(group_id=f"g{seed}-{g}", samples=samples).model_dump())
    return out


# ---- train-only runs against a real buffer ----------------------------------------------------
def synthetic_groups(n: int, start: int = 0, vocab: int = 512, size: int = 4) -> list[Group]:
    """Each prompt has one rewarded answer (tokens fixed per prompt) and random unrewarded ones."""
    out = []
    for g in range(start, start + n):
        rng = random.Random(g % 8)  # 8 distinct prompts, seen again and again: a fixed task
        prompt = [rng.randrange(3, vocab) for _ in range(5)]
        target = [rng.randrange(3, vocab) for _ in range(4)]
        noise = random.Random(10_000 + g)
        samples = []
        for i in range(size):
            good = i < size // 2
            resp = target if good else [noise.randrange(3, vocab) for _ in range(4)]
            samples.append(Sample(uid=f"u{g}-{i}", group_id=f"g{g}", index=i, tokens=prompt + resp,
                                  response_length=4, loss_mask=[1] * 4, rollout_logprobs=[-6.0] * 4,
                                  reward=1.0 if good else 0.0))
        out.append(Group(group_id=f"g{g}", samples=samples))
    return out


def write_config(tmp_path: Path, model_dir: Path, url: str, lease_s: float = 120, **trainer) -> Path:
    """A train-only run config (``tmp_path/run.yaml``) against the buffer at ``url``."""
    # max_staleness as the buffer was started: the fixed groups (weight_version 0) stay leasable
    cfg = {"model": str(model_dir), "buffer": {"url": url, "lease_s": lease_s, "max_staleness": 1000},
           "rollout": {"groups_per_step": GROUPS_PER_STEP},
           "trainer": {"tp": 1, "dp": 1, "lr": 3e-3, "steps": 100, "lease_wait_s": 1.0, "micro_batch_tokens": 64,
                       "checkpoint_dir": str(tmp_path / "ckpt"), "threads": 1, **trainer},
           "run": {"out": str(tmp_path / "out")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    load_config(path)  # the file is a valid run config
    return path


def run_train(tmp_path: Path, config: Path, url: str, timeout: float = 400) -> tuple[int, str]:
    proc = Proc(headrace_cmd("train", "--config", str(config), "--buffer-url", url), tmp_path / "train.log",
                env=child_env(threads=1))
    try:
        rc = proc.popen.wait(timeout)
    finally:
        proc.stop()
    return rc, (tmp_path / "train.log").read_text()


def metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def bad_group(kind: str, gid: str, vocab: int = 512) -> Group:
    toks = [5, 6, 7]
    if kind == "vocab":
        s = [Sample(uid=f"{gid}-0", group_id=gid, tokens=toks + [vocab + 3], response_length=1, loss_mask=[1], reward=1.0)]
    elif kind == "prompt":
        s = [Sample(uid=f"{gid}-0", group_id=gid, index=0, tokens=toks + [9], response_length=1, loss_mask=[1], reward=1.0),
             Sample(uid=f"{gid}-1", group_id=gid, index=1, tokens=[5, 8, 7, 9], response_length=1, loss_mask=[1], reward=0.0)]
    else:  # nothing to train on: every token masked
        s = [Sample(uid=f"{gid}-0", group_id=gid, tokens=toks + [9], response_length=1, loss_mask=[0], reward=1.0)]
    return Group(group_id=gid, samples=s)
