"""``headrace model logprobs``: per-token log-probabilities from the trainer's model at TP=N.

The parity tool for train/inference mismatch: for every input line ``{"tokens": [t0, ..., tn]}``
it writes ``{"logprobs": [l1, ..., ln]}`` where ``li = log p(ti | t0..t(i-1))`` under the trainer's
tensor-parallel model (fp32, temperature 1), computed by N processes over gloo (``trainer.launch``).

Guarantees: the input is validated before any process starts (bad JSON, a missing or non-integer
``tokens`` list, an empty list, ids outside the vocabulary: an error naming the line); output line
i answers input line i (blank input lines are skipped); the output file appears complete or not at
all (written to a temporary name, then renamed). Sequences are packed into forward passes of at
most ``max_tokens`` tokens, never split.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from headrace.shared.hf_arch import ArchConfig
from headrace.trainer.model.support import check_tp_compatible


def read_token_lines(path: str | Path, vocab_size: int) -> list[list[int]]:
    """Parse and validate the input JSONL; raise ValueError naming the first bad line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file {p} not found")
    out: list[list[int]] = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
        toks = obj.get("tokens") if isinstance(obj, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ValueError(f'{p}:{n}: expected {{"tokens": [int, ...]}}')
        if not toks:
            raise ValueError(f"{p}:{n}: tokens is empty (need at least one token)")
        bad = next((t for t in toks if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{p}:{n}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        out.append(toks)
    return out


def _batches(seqs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of ``seqs`` grouped into packs of at most ``max_tokens`` tokens (one long sequence alone)."""
    packs: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, s in enumerate(seqs):
        if cur and size + len(s) > max_tokens:
            packs.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += len(s)
    if cur:
        packs.append(cur)
    return packs


def rank_main(model_dir: str, tp: int, seqs: list[list[int]], max_tokens: int) -> list[list[float]] | None:
    """One TP rank: load the shard, compute every sequence's logprobs; rank 0 returns them."""
    import torch

    from headrace.trainer.model import load_model
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp, backend="gloo")     # an fp32 CPU reference, even on a GPU machine
    try:
        model = load_model(model_dir, info, torch.float32).eval()
        results: list[list[float]] = [[] for _ in seqs]
        with torch.no_grad():
            for pack in _batches(seqs, max_tokens):
                ids = torch.tensor([t for i in pack for t in seqs[i]], dtype=torch.long)
                pos = torch.cat([torch.arange(len(seqs[i])) for i in pack])
                lens = torch.tensor([len(seqs[i]) for i in pack])
                cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
                targets = torch.roll(ids, -1)    # last position of each sequence is dropped below
                lp, _ = model.token_logprobs(ids, pos, cu, targets)
                for j, i in enumerate(pack):
                    results[i] = lp[int(cu[j]): int(cu[j + 1]) - 1].tolist()
        return results if info.rank == 0 else None
    finally:
        destroy_distributed()


def run(model_dir: str | Path, tp: int, input_path: str | Path, output_path: str | Path,
        max_tokens: int = 4096, timeout_s: float = 3600) -> int:
    """Validate, compute at TP=``tp`` in ``tp`` processes, write the output; returns the line count."""
    from headrace.trainer.launch import spawn

    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    arch = ArchConfig.from_model_dir(model_dir)
    check_tp_compatible(arch, tp)
    seqs = read_token_lines(input_path, arch.vocab_size)
    results: Any = spawn(rank_main, tp, str(model_dir), tp, seqs, max_tokens, timeout_s=timeout_s)[0]
    out = Path(output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        for lps in results:
            f.write(json.dumps({"logprobs": lps}) + "\n")
    os.replace(tmp, out)
    return len(results)
