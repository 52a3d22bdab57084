"""Is the CPU demo feasible? Warm start + GRPO on chain_sum in ONE plain process, printing the curve.

Recipe (DESIGN.md, deploy/demo.py): tiny-qwen2 (~1M params) -> ``warm_start`` (supervised, stops at
~0.22 greedy accuracy) -> GRPO with 32 prompts x 8 samples, temperature 1.0, AdamW lr 1e-4, grad
clip 1.0, binary reward, group-normalised advantages (``trainer.loss.group_advantages``), token-mean
PPO-clip loss (``trainer.loss.policy_loss``), on-policy (one optimizer step per batch, the
sampling logprobs as old logprobs). Sampling is a plain KV-cached loop over a transformers model.

Prints one line per evaluation: step, elapsed wall seconds (total and GRPO-only), mean training
reward, greedy accuracy on 128 held-out items (seed + 10**7). With ``--json`` writes the curve.
The services are not involved: this is the upper bound `headrace run` approaches.

    python bench/demo_feasibility.py --steps 400 --eval-every 10 --threads 1

Measured 2026-11-29 on the shared 2-core machine (load average 11-14, so wall times are ~4x
inflated; CPU time per GRPO step with one thread: 0.56 s), seed 0:
warm start 88 steps -> 0.227; GRPO lr 1e-4: step 50 0.26, 100 0.26, 150 0.40, 200 0.40,
250 0.42, 300 0.43, 350 0.45, 400 0.53. lr 2e-4: 0.41 at step 250 with a dip to 0.24 at step 200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--workdir", default="runs/demo_feasibility", help="models are cached here")
    ap.add_argument("--json", default=None, help="write the curve here")
    ap.add_argument("--model", default=None, help="a warm-started model directory to start from "
                    "(skips init and warm-up; bench/demo_vs_plain.py passes the demo's own)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from headrace.deploy.demo import (MAX_NEW_TOKENS, _load, eval_items, generate, model_accuracy, render_prompt,
                             reward, sequence_logprobs, task_items, warm_start)
    from headrace.shared.modelzoo import init_model
    from headrace.trainer.loss import group_advantages, policy_loss

    work = Path(args.workdir)
    t0 = time.time()
    if args.model:
        warm = Path(args.model)
    else:
        base = init_model("tiny-qwen2", work / "base", seed=args.seed)
        warm = warm_start(base, work / "warm", seed=args.seed,
                          log=lambda s: print(f"[{time.time() - t0:6.1f}s] {s}", flush=True))
    meta = json.loads((warm / "warm_start.json").read_text())
    print(f"[{time.time() - t0:6.1f}s] warm start: {meta['steps_run']} steps, accuracy {meta['accuracy']:.3f}",
          flush=True)

    torch.manual_seed(args.seed)
    model, tok = _load(warm)
    eos = tok.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    evals = eval_items(128, args.seed)
    pool = task_items(args.seed, args.steps * args.groups)
    g, n = args.groups, args.group_size
    curve: list[dict[str, float]] = []
    t_rl, train_s = time.time(), 0.0

    def evaluate(step: int, reward_mean: float | None) -> None:
        acc = model_accuracy(model, tok, evals)
        row = {"step": step, "elapsed_s": round(time.time() - t_rl, 1), "grpo_s": round(train_s, 1),
               "reward_mean": reward_mean, "eval_accuracy": acc}
        curve.append(row)
        print(f"step {step:4d}  elapsed {row['elapsed_s']:7.1f}s  (grpo {row['grpo_s']:6.1f}s)  "
              f"reward {'-' if reward_mean is None else f'{reward_mean:.3f}'}  eval {acc:.3f}", flush=True)

    evaluate(0, None)
    recent: list[float] = []
    for step in range(1, args.steps + 1):
        ts = time.time()
        items = pool[(step - 1) * g: step * g]
        prompts = [tok(render_prompt(e["question"]))["input_ids"] for e in items for _ in range(n)]
        entries = [e for e in items for _ in range(n)]
        model.eval()
        responses, old = generate(model, prompts, max_new_tokens=MAX_NEW_TOKENS, eos_id=eos,
                                  temperature=1.0, generator=gen)
        texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
        rewards = torch.tensor([reward(t, e) for t, e in zip(texts, entries)])
        adv = group_advantages(rewards, n)
        model.train()
        lps, masks, rows = sequence_logprobs(model, prompts, responses, pad_id=eos)
        total_tokens = sum(m.sum() for m in masks)
        loss = torch.zeros(())
        for lp, m, idx in zip(lps, masks, rows):
            old_lp = torch.zeros_like(lp)
            for j, i in enumerate(idx):
                old_lp[j, :len(old[i])] = torch.tensor(old[i])
            part, _ = policy_loss(lp, old_lp, adv[idx], m, aggregation="token_mean")
            loss = loss + part * (m.sum() / total_tokens)     # bucket token-means -> batch token-mean
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_s += time.time() - ts
        recent.append(float(rewards.mean()))
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step, sum(recent) / len(recent))
            recent = []
    if args.json:
        Path(args.json).write_text(json.dumps({"warm_start": meta, "curve": curve}, indent=2) + "\n")
    first, best = curve[0]["eval_accuracy"], max(r["eval_accuracy"] for r in curve)
    print(f"eval accuracy {first:.3f} -> {curve[-1]['eval_accuracy']:.3f} (best {best:.3f}) in {args.steps} steps, "
          f"{curve[-1]['elapsed_s']:.0f}s wall ({train_s / args.steps:.2f}s per GRPO step, threads={args.threads})")


if __name__ == "__main__":
    main()
