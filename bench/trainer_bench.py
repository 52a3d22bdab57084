"""Training throughput of the trainer's model vs transformers' model, same loss, same batch, one run.

What one "training step" is, on both sides: recompute old logprobs (no-grad forward), forward with
grad, per-token logprobs of the response tokens, the GRPO PPO-clip loss (``trainer.loss``, token
mean), backward, grad-norm clipping, AdamW step. Ours runs ``trainer.step.train_step`` on packed
sequences (no padding); transformers runs its ``AutoModelForCausalLM`` on the usual right-padded
``[B, L]`` batch with an attention mask. Throughput counts real (unpadded) tokens only, so padding
is overhead charged to the side that needs it — that is the point of packing.

Reported: median step time over ``--steps`` timed steps after one warm-up step, tokens/s, the ratio
ours / transformers at TP=1 (target >= 0.9), the largest per-token logprob difference between the
two models on the batch (they must compute the same thing), and TP=2 (two gloo processes with one
thread each) against TP=1 on the same cores. Prints one JSON line at the end.

    python bench/trainer_bench.py [--preset qwen2-5m] [--groups 8] [--group-size 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_groups(groups: int, size: int, prompt_len: int, resp_min: int, resp_max: int, vocab: int, seed: int = 0):
    from headrace.shared.schemas import Group, Sample

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        samples = []
        for i in range(size):
            n = rng.randrange(resp_min, resp_max + 1)
            samples.append(Sample(uid=f"{g}-{i}", group_id=f"g{g}", index=i,
                                  tokens=prompt + [rng.randrange(3, vocab) for _ in range(n)], response_length=n,
                                  loss_mask=[1] * n, reward=float(rng.random() < 0.5)))
        out.append(Group(group_id=f"g{g}", samples=samples).model_dump())
    return out


def _trainer_cfg():
    from headrace.shared.config import TrainerConfig

    return TrainerConfig(lr=1e-5, grad_clip=1.0, micro_batch_tokens=1 << 20)


def _ours_setup(model_dir: str, groups: list[dict], info):
    """Our model and its packed batch; returns (step_fn -> (seconds, tokens), logprobs per sample)."""
    import torch

    from headrace.trainer.batch import build_batch, pack
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.step import TrainerState, train_step

    cfg = _trainer_cfg()
    model = load_model(model_dir, info)
    opt = build_optimizer(model, cfg)
    st = TrainerState(model, opt, build_scheduler(opt, cfg), cfg, info)
    batch = build_batch(groups, vocab_size=model.arch.vocab_size)
    (mb,) = pack(batch, range(len(batch.samples)), 1 << 20)
    with torch.no_grad():
        lp = model.token_logprobs(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.target_ids)[0]
    per_sample = {i: lp[int(mb.cu_seqlens[k]):int(mb.cu_seqlens[k + 1])].tolist() for k, i in enumerate(mb.sample_ids)}

    def step() -> tuple[float, int]:
        m = train_step(st, batch)
        return m["step_time_s"], int(m["tokens"])

    return step, per_sample


def interleaved(model_dir: str, groups: list[dict], steps: int) -> dict:
    """Ours (TP=1) and transformers in one process, steps alternating, so load on a shared machine
    hits both alike."""
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(1, 1)
    try:
        ours_step, ours_lp = _ours_setup(model_dir, groups, info)
        hf_step, hf_lp, padded = _hf_setup(model_dir, groups)
        a, h = [], []
        for s in range(steps + 1):
            ta, tokens = ours_step()
            th, hf_tokens = hf_step()
            if s:
                a.append(ta)
                h.append(th)
        diff = max(max(abs(x - y) for x, y in zip(ours_lp[i], hf_lp[i])) for i in ours_lp)
        return {"ours_s": statistics.median(a), "hf_s": statistics.median(h), "tokens": tokens,
                "hf_tokens": hf_tokens, "padded": padded, "diff": diff}
    finally:
        destroy_distributed()


def ours(model_dir: str, groups: list[dict], steps: int, tp: int) -> dict | None:
    """Our model through the real train step on one rank of a TP job."""
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp, 1)
    try:
        step, _ = _ours_setup(model_dir, groups, info)
        times = []
        for s in range(steps + 1):
            t, tokens = step()
            if s:
                times.append(t)
        return {"median_s": statistics.median(times), "tokens": tokens} if info.rank == 0 else None
    finally:
        destroy_distributed()


def _hf_setup(model_dir: str, groups: list[dict]):
    """transformers' model on the padded batch, with the same loss and optimizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from headrace.trainer.batch import build_batch
    from headrace.trainer.loss import group_advantages, policy_loss
    from headrace.trainer.optim import build_optimizer

    cfg = _trainer_cfg()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    opt = build_optimizer(model, cfg)
    batch = build_batch(groups, vocab_size=model.config.vocab_size)
    S = batch.samples
    L = max(len(s.tokens) for s in S) - 1
    inp = torch.zeros(len(S), L, dtype=torch.long)
    tgt = torch.zeros(len(S), L, dtype=torch.long)
    att = torch.zeros(len(S), L, dtype=torch.long)
    mask = torch.zeros(len(S), L)
    for i, s in enumerate(S):
        n = len(s.tokens) - 1
        inp[i, :n] = torch.tensor(s.tokens[:-1])
        tgt[i, :n] = torch.tensor(s.tokens[1:])
        att[i, :n] = 1
        mask[i, s.prompt_len - 1:n] = torch.tensor(s.loss_mask, dtype=torch.float32)
    rewards, _ = batch.rewards()

    def logprobs():
        logits = model(input_ids=inp, attention_mask=att).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        lp0 = logprobs()
    per_sample = {i: lp0[i, : len(s.tokens) - 1].tolist() for i, s in enumerate(S)}

    def step() -> tuple[float, int]:
        t0 = time.perf_counter()
        with torch.no_grad():
            old = logprobs()
        adv = group_advantages(rewards, batch.group_sizes[0])
        loss, _ = policy_loss(logprobs(), old, adv, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        return time.perf_counter() - t0, int(att.sum())

    return step, per_sample, int(att.numel())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2-5m")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--resp-min", type=int, default=16)
    ap.add_argument("--resp-max", type=int, default=96)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-tp2", action="store_true")
    args = ap.parse_args()

    import torch

    from headrace.shared.modelzoo import init_model
    from headrace.trainer.launch import spawn

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model(args.preset, Path(tmp) / args.preset))
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        groups = make_groups(args.groups, args.group_size, args.prompt_len, args.resp_min, args.resp_max, vocab)
        (r,) = spawn(interleaved, 1, model_dir, groups, args.steps, threads=args.threads, timeout_s=3600)
        out = {"preset": args.preset, "threads": args.threads, "sequences": args.groups * args.group_size,
               "tokens": r["tokens"], "hf_padded_tokens": r["padded"],
               "ours_tp1_tok_s": r["tokens"] / r["ours_s"], "hf_tok_s": r["hf_tokens"] / r["hf_s"],
               "max_logprob_diff": r["diff"]}
        out["ratio_tp1_vs_hf"] = out["ours_tp1_tok_s"] / out["hf_tok_s"]
        print(f"ours TP=1     : {out['ours_tp1_tok_s']:9.0f} tok/s  (median step {r['ours_s']:.3f} s)")
        print(f"transformers  : {out['hf_tok_s']:9.0f} tok/s  (median step {r['hf_s']:.3f} s, "
              f"{r['padded']} padded for {r['hf_tokens']} real tokens)")
        print(f"ratio ours/HF : {out['ratio_tp1_vs_hf']:.2f}x  (target >= 0.9); max |logprob diff| {r['diff']:.2e}")
        if not args.no_tp2:
            per = max(1, args.threads // 2)
            (t2, _) = spawn(ours, 2, model_dir, groups, args.steps, 2, threads=per, timeout_s=1800)
            out["ours_tp2_tok_s"] = t2["tokens"] / t2["median_s"]
            out["ratio_tp2_vs_tp1"] = out["ours_tp2_tok_s"] / out["ours_tp1_tok_s"]
            print(f"ours TP=2     : {out['ours_tp2_tok_s']:9.0f} tok/s  ({per} thread(s) per rank, gloo; "
                  f"{out['ratio_tp2_vs_tp1']:.2f}x TP=1 on the same {args.threads} cores)")
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
