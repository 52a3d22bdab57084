"""Reference engine vs ``transformers`` generate(): tokens/s at 64 concurrent requests, same model.

Both sides use the same model directory (default preset qwen2-5m, written offline), the same 64
prompts, 128 new tokens each (EOS ignored: ``ignore_eos`` for the engine,
``generation_config.eos_token_id = None`` for HF), sampling at temperature 1, and the same number
of torch threads. The engine runs as a real ``headrace engine serve`` process and is driven over
HTTP with 64 concurrent ``/generate`` requests; HF generate() runs one batch of 64 in this
process. Rounds alternate between the two and the medians are compared.

    python bench/engine_bench.py [--preset qwen2-5m] [--batch 64] [--new-tokens 128] [--threads 1]

Prints the tokens/s of each and the ratio engine / HF (target >= 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.procs import Proc, child_env, free_port, headrace_cmd  # noqa: E402


def hf_run(model, prompts: torch.Tensor, new_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=0)
    dt = time.perf_counter() - t0
    produced = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    assert produced == prompts.shape[0] * new_tokens, f"HF produced {produced} tokens"
    return produced, dt


async def engine_run(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=len(prompts))) as client:
        async def one(p: list[int]) -> int:
            r = await client.post(f"{url}/generate", json={"input_ids": p, "sampling_params": sp})
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t0
    produced = sum(counts)
    assert produced == len(prompts) * new_tokens, f"engine produced {produced} tokens"
    return produced, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-5m")
    ap.add_argument("--model", default=None, help="an existing HF model directory instead of --preset")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tmp = tempfile.TemporaryDirectory(prefix="engine-bench-")
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        from shared.modelzoo import init_model

        model_dir = init_model(args.preset, Path(tmp.name) / args.preset)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 500), (args.batch, args.prompt_len), generator=g)
    n_params = sum(p.numel() for p in hf.parameters())

    port = free_port()
    proc = Proc(headrace_cmd("engine", "serve", "--model", str(model_dir), "--port", str(port),
                             "--threads", str(args.threads)),
                Path(tmp.name) / "engine.log", env=child_env(threads=args.threads))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=120)
        asyncio.run(engine_run(url, prompts[:4].tolist(), 8))   # warm-up
        hf_run(hf, prompts[:4], 8)
        eng, ref = [], []
        for _ in range(args.rounds):
            n, dt = asyncio.run(engine_run(url, prompts.tolist(), args.new_tokens))
            eng.append(n / dt)
            n, dt = hf_run(hf, prompts, args.new_tokens)
            ref.append(n / dt)
    finally:
        proc.stop()
        tmp.cleanup()
    e, h = statistics.median(eng), statistics.median(ref)
    print(f"model {args.model or args.preset} ({n_params / 1e6:.1f}M params), batch {args.batch} x "
          f"{args.new_tokens} new tokens, prompt {args.prompt_len}, torch threads {args.threads}")
    print(f"reference engine (HTTP, {args.batch} concurrent requests): {e:8.0f} tokens/s   rounds {[round(x) for x in eng]}")
    print(f"transformers generate() (one batch of {args.batch}):       {h:8.0f} tokens/s   rounds {[round(x) for x in ref]}")
    print(f"ratio engine / HF: {e / h:.2f}x (target >= 1.0)")


if __name__ == "__main__":
    main()
