"""Engines vs ``transformers`` generate(): tokens/s at 64 concurrent requests, same model.

Engines: the reference engine, vLLM 0.32 on CPU (through Headrace's SGLang-API adapter, as the
rollout service sees it) where ``.venv-vllm`` exists, and SGLang 0.5.23 on CPU where
``.venv-sglang`` exists; each is reported as a ratio to ``transformers`` in the same rounds.

Both sides use the same model directory (default preset qwen2-5m, written offline), the same 64
prompts, 128 new tokens each (EOS ignored: ``ignore_eos`` for the engine,
``generation_config.eos_token_id = None`` for HF), sampling at temperature 1, and the same number
of torch threads. The engine runs as a real ``headrace engine serve`` process and is driven over
HTTP with 64 concurrent ``/generate`` requests; HF generate() runs one batch of 64 in this
process. Rounds alternate between the two (the machine may be shared: adjacent runs see the same
load); the ratio of the medians and the median of the per-round ratios are printed.

    python bench/engine_bench.py [--preset qwen2-5m] [--batch 64] [--new-tokens 128] [--threads 1]
                                 [--engines reference,vllm,sglang]

Prints the tokens/s of each and the ratio engine / HF (target >= 1.0 for the reference engine).
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

import orjson  # noqa: E402
import torch  # noqa: E402

from tests.procs import SGLANG_PYTHON, VLLM_PYTHON, Proc, child_env, free_port, headrace_cmd  # noqa: E402


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


async def _post(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], port: int, body: bytes) -> dict:
    reader, writer = conn
    writer.write(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (port, len(body)) + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    payload = orjson.loads(await reader.readexactly(length))
    if status != 200:
        raise RuntimeError(f"/generate answered {status}: {payload}")
    return payload


async def engine_run(port: int, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """Send every prompt as its own concurrent /generate request over its own keep-alive connection.

    A minimal asyncio HTTP/1.1 client: httpx's AsyncClient spends ~20 ms of CPU per request at this
    concurrency on a loaded 2-core machine, which would measure the client, not the engine.
    """
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    bodies = [orjson.dumps({"input_ids": p, "sampling_params": sp}) for p in prompts]
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in prompts]
    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_post(c, port, b) for c, b in zip(conns, bodies)))
        dt = time.perf_counter() - t0
    finally:
        for _, w in conns:
            w.close()
    produced = sum(r["meta_info"]["completion_tokens"] for r in results)
    assert produced == len(prompts) * new_tokens, f"engine produced {produced} tokens"
    return produced, dt


def start_engine(kind: str, model_dir: Path, tmp: Path, threads: int) -> tuple[Proc | object, int]:
    """Start one engine serving SGLang's API; (handle with .stop(), port)."""
    if kind == "reference":
        port = free_port()
        proc = Proc(headrace_cmd("engine", "serve", "--model", str(model_dir), "--port", str(port),
                                 "--threads", str(threads)), tmp / "engine.log", env=child_env(threads=threads))
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
        return proc, port
    if kind == "vllm":
        from tests.vllm.support import VLLMEngine

        eng = VLLMEngine(model_dir, tmp / "vllm.log").start()
        return eng, eng.port
    if kind == "sglang":
        from tests.sglang.sglang_cpu.server import SGLangServer

        srv = SGLangServer(model_dir, tmp / "sglang.log").start()
        return srv, srv.port
    raise SystemExit(f"unknown engine {kind!r} (reference, vllm, sglang)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-5m")
    ap.add_argument("--model", default=None, help="an existing HF model directory instead of --preset")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    default = ["reference"] + [k for k, py in (("vllm", VLLM_PYTHON), ("sglang", SGLANG_PYTHON)) if py.exists()]
    ap.add_argument("--engines", default=",".join(default), help="comma-separated: reference, vllm, sglang")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tmp = tempfile.TemporaryDirectory(prefix="engine-bench-")
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        from headrace.shared.modelzoo import init_model

        model_dir = init_model(args.preset, Path(tmp.name) / args.preset)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 500), (args.batch, args.prompt_len), generator=g)
    n_params = sum(p.numel() for p in hf.parameters())

    print(f"model {args.model or args.preset} ({n_params / 1e6:.1f}M params), batch {args.batch} x "
          f"{args.new_tokens} new tokens, prompt {args.prompt_len}, torch threads {args.threads}", flush=True)
    try:
        for kind in args.engines.split(","):
            handle, port = start_engine(kind, model_dir, Path(tmp.name), args.threads)
            try:
                asyncio.run(engine_run(port, prompts[:4].tolist(), 8))   # warm-up
                hf_run(hf, prompts[:4], 8)
                eng, ref = [], []
                for _ in range(args.rounds):
                    n, dt = asyncio.run(engine_run(port, prompts.tolist(), args.new_tokens))
                    eng.append(n / dt)
                    n, dt = hf_run(hf, prompts, args.new_tokens)
                    ref.append(n / dt)
            finally:
                handle.stop()
            e, h = statistics.median(eng), statistics.median(ref)
            paired = statistics.median(a / b for a, b in zip(eng, ref))
            print(f"{kind + ' engine':18s} (HTTP, {args.batch} concurrent requests): {e:8.0f} tokens/s   "
                  f"rounds {[round(x) for x in eng]}")
            print(f"{'transformers':18s} generate() (one batch of {args.batch}):   {h:8.0f} tokens/s   "
                  f"rounds {[round(x) for x in ref]}")
            print(f"ratio {kind} / HF: {e / h:.2f}x of medians, {paired:.2f}x median of paired rounds", flush=True)
    finally:
        tmp.cleanup()


if __name__ == "__main__":
    main()
