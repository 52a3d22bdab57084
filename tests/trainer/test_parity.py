"""Parity of the trainer's TP decoder with transformers, at TP=1 and TP=2, in real gloo processes.

Models: the tiny-qwen2 / tiny-llama / qwen3-tiny presets with every tensor perturbed (the presets
have unit norms and zero biases, which would hide a mis-loaded norm or bias), and a Llama built
here with sizes TP=2 does not divide (vocab 301, 6 heads / 3 kv heads, MLP 75), attention and MLP
biases and llama3 rope scaling. Reference: ``AutoModelForCausalLM`` on the same directory, fp32,
one sequence at a time; ours runs the sequences packed into one stream. Tolerance 1e-4 on every
per-token logprob (the issue's bar) and on the entropy.

The model builders and the packing helper are in tests/trainer/support.py (shared with test_tp_model
and test_hf_io).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.procs import child_env, headrace_cmd
from tests.trainer.support import SEQ_LENS, odd_llama, packed, preset_model, token_seqs

TOL = 1e-4


def hf_reference(model_dir: Path, seqs: list[list[int]], temperature: float = 1.0) -> tuple[Any, Any]:
    """transformers' per-token logprob of the next token and entropy, per sequence, concatenated.

    Position i of a sequence holds log p(token[i+1] | ..token[i]); the last position of each
    sequence holds 0 (no next token), the same convention as ``packed``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lps, ents = [], []
    with torch.no_grad():
        for s in seqs:
            logp = (hf(torch.tensor([s])).logits[0].float() / temperature).log_softmax(-1)
            nxt = torch.tensor(s[1:] + [s[0]])
            lp = logp.gather(-1, nxt[:, None])[:, 0]
            lp[-1] = 0.0
            lps.append(lp)
            ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps), torch.cat(ents)


# ----------------------------------------------------------------------------- rank functions
def rank_logprobs(tp: int, jobs: list[tuple[str, list[list[int]]]], temperature: float) -> list[tuple[Any, Any]]:
    """In every rank: load each model at TP=tp and return (logprobs, entropy) with the mask applied."""
    import torch

    from headrace.trainer.model import load_model
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp)
    out = []
    with torch.no_grad():
        for model_dir, seqs in jobs:
            model = load_model(model_dir, info)
            ids, pos, cu, targets, mask = packed(seqs)
            lp, ent = model.token_logprobs(ids, pos, cu, targets, temperature=temperature, with_entropy=True)
            out.append((torch.where(mask, lp, 0.0), ent))
    destroy_distributed()
    return out


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    out = {p: preset_model(p, root / p) for p in ("tiny-qwen2", "tiny-llama", "qwen3-tiny")}
    out["odd-llama"] = odd_llama(root / "odd-llama")
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_and_entropy_match_transformers(models: dict[str, Path], tp: int) -> None:
    import torch

    from headrace.trainer.launch import spawn

    temperature = 1.0 if tp == 1 else 0.7          # TP=2 also covers the temperature divisor
    jobs, names = [], []
    for name, d in models.items():
        vocab = json.loads((d / "config.json").read_text())["vocab_size"]
        # uneven lengths (one attention call per sequence) and equal lengths (one batched call)
        for lens in (SEQ_LENS, (6, 6, 6)):
            jobs.append((str(d), token_seqs(vocab, lens)))
            names.append(f"{name} {lens}")
    results = spawn(rank_logprobs, tp, tp, jobs, temperature, timeout_s=600)
    for name, (model_dir, seqs), *ranks in zip(names, jobs, *results):
        ref_lp, ref_ent = hf_reference(Path(model_dir), seqs, temperature)
        for r, (lp, ent) in enumerate(ranks):            # every TP rank holds the full answer
            assert lp.shape == ref_lp.shape
            err_lp = (lp - ref_lp).abs().max().item()
            err_ent = (ent - ref_ent).abs().max().item()
            assert err_lp < TOL, f"{name} TP={tp} rank {r}: logprob differs by {err_lp}"
            assert err_ent < TOL, f"{name} TP={tp} rank {r}: entropy differs by {err_ent}"
        assert torch.isfinite(ref_lp).all()


@pytest.mark.slow
def test_smollm2_parity_tp1_tp2(tmp_path: Path) -> None:
    from headrace.shared.modelzoo import init_model
    from headrace.trainer.launch import spawn

    d = Path(init_model("smollm2-135m", tmp_path / "smollm2"))
    seqs = token_seqs(49152, (24, 9), seed=3)
    ref_lp, ref_ent = hf_reference(d, seqs)
    for tp in (1, 2):                                  # 9 heads / 3 kv heads: TP=2 pads to 12 / 4
        lp, ent = spawn(rank_logprobs, tp, tp, [(str(d), seqs)], 1.0, timeout_s=900)[0][0]
        assert (lp - ref_lp).abs().max().item() < TOL, f"TP={tp}"
        assert (ent - ref_ent).abs().max().item() < TOL, f"TP={tp}"


def test_cli_model_logprobs_tp2(models: dict[str, Path], tmp_path: Path) -> None:
    d = models["odd-llama"]
    seqs = token_seqs(301, (9, 1, 15), seed=5)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in seqs))
    proc = subprocess.run(headrace_cmd("model", "logprobs", "--model", str(d), "--tp", "2", "--input", str(inp),
                                       "--output", str(out)), env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(x["logprobs"]) for x in lines] == [len(s) - 1 for s in seqs]
    ref_lp, _ = hf_reference(d, seqs)
    start = 0
    for s, line in zip(seqs, lines):
        ref = ref_lp[start:start + len(s) - 1].tolist()
        assert max((abs(a - b) for a, b in zip(line["logprobs"], ref)), default=0.0) < TOL
        start += len(s)


def test_cli_model_logprobs_rejects_bad_input(models: dict[str, Path], tmp_path: Path) -> None:
    d = models["odd-llama"]
    cases = {'{"tokens": [1, 2, 301]}\n': "token id 301 is outside the vocabulary",
             '{"tokens": [1, 2]}\n{"tokens": []}\n': "in.jsonl:2: tokens is empty",
             '{"tokens": [1, 2]}\n{"toks": [1]}\n': 'in.jsonl:2: expected {"tokens"',
             "not json\n": "in.jsonl:1: not valid JSON"}
    for text, message in cases.items():
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text(text)
        proc = subprocess.run(headrace_cmd("model", "logprobs", "--model", str(d), "--tp", "2", "--input", str(inp),
                                           "--output", str(out)), env=child_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, (text, proc.stderr)
        assert message in proc.stderr, (text, proc.stderr)
        assert not out.exists()
