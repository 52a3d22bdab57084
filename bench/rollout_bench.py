"""Rollout service overhead: groups/s through the service vs the same requests straight to the engines.

One run starts a buffer (``--memory``) and ``--engines`` reference engines as real processes, then
alternates two ways of producing the same work (``--groups`` groups x ``--n`` samples of
``--new-tokens`` tokens, EOS ignored so every sequence has the same length):

- direct: this process tokenizes the prompts and sends every /generate straight to the engines
  (round-robin, all concurrently, return_logprob on), nothing else;
- service: ``headrace rollout serve`` attached to the same engines (backend external, on_demand)
  answers ``POST /v1/generate_batch`` — routing, logprobs, reward (exact_match), group validation
  and the push to the buffer included.

    python bench/rollout_bench.py [--preset tiny-qwen2] [--engines 1] [--groups 32] [--n 8] [--new-tokens 16]

Prints groups/s of each (medians over ``--rounds``), the ratio service / direct and the overhead
(target: overhead <= 10%). The service shares the CPU with the engines here; on 2 cores that
contention is part of what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import yaml  # noqa: E402

from tests.procs import Proc, child_env, free_port, headrace_cmd  # noqa: E402


async def direct_round(urls: list[str], prompts: list[list[int]], n: int, sampling: dict) -> float:
    # the same client settings as the service's fleet (rollout/fleet.py), so only the service differs
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=16, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        async def one(i: int, p: list[int]) -> None:
            r = await client.post(f"{urls[i % len(urls)]}/generate",
                                  json={"input_ids": p, "sampling_params": sampling, "return_logprob": True})
            r.raise_for_status()
            out = r.json()
            assert len(out["output_ids"]) == sampling["max_new_tokens"], out["meta_info"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i * n + j, p) for i, p in enumerate(prompts) for j in range(n)))
        return time.perf_counter() - t0


def service_round(url: str, groups: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/generate_batch", json={"groups": groups}, timeout=900.0)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    assert r.json()["groups"] == groups, r.text
    return dt


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-qwen2")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    args = ap.parse_args()

    from shared.modelzoo import init_model, load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    model = init_model(args.preset, tmp / "model")
    tok = load_tokenizer(model)
    total_prompts = args.groups * (2 * args.rounds + 2)
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i % 97} + {i % 13} =", "label": str(i % 97 + i % 13)}) + "\n"
                            for i in range(total_prompts)))
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in data.read_text().splitlines()]
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}

    procs: list[Proc] = []
    try:
        bport = free_port()
        procs.append(Proc(headrace_cmd("buffer", "serve", "--port", str(bport), "--memory", "--capacity", "1000000"),
                          tmp / "buffer.log"))
        urls = []
        for i in range(args.engines):
            port = free_port()
            procs.append(Proc(headrace_cmd("engine", "serve", "--model", str(model), "--port", str(port),
                                           "--threads", str(args.threads)), tmp / f"engine-{i}.log",
                              env=child_env(threads=args.threads)))
            urls.append(f"http://127.0.0.1:{port}")
        procs[0].wait_http(f"http://127.0.0.1:{bport}/health")
        for p, u in zip(procs[1:], urls):
            p.wait_http(f"{u}/health", timeout=120)
        rport = free_port()
        cfg = tmp / "run.yaml"
        cfg.write_text(yaml.safe_dump({
            "model": str(model), "buffer": {"url": f"http://127.0.0.1:{bport}", "capacity": 1000000},
            "rollout": {"engines": {"backend": "external", "urls": urls}, "mode": "on_demand",
                        "data": {"path": str(data), "shuffle": False}, "n_samples_per_prompt": args.n,
                        "max_concurrency": args.groups * args.n, "reward": "exact_match",
                        "sampling": {k: v for k, v in sampling.items()}},
            "run": {"out": str(tmp / "run")}}))
        svc = Proc(headrace_cmd("rollout", "serve", "--config", str(cfg), "--port", str(rport)), tmp / "rollout.log",
                   env=child_env(HEADRACE_LOG_LEVEL="WARNING"))
        procs.append(svc)
        url = f"http://127.0.0.1:{rport}"
        svc.wait_http(f"{url}/health", timeout=120)

        # warm-up both paths (engine caches, connection pools, first-call imports)
        asyncio.run(direct_round(urls, prompts[: args.groups], args.n, sampling))
        service_round(url, args.groups)
        direct_s, service_s = [], []
        offset = args.groups
        svc_cpu = direct_cpu = 0.0
        for r in range(args.rounds):  # alternate the order so drifting background load hits both
            for which in (("direct", "service") if r % 2 == 0 else ("service", "direct")):
                if which == "direct":
                    c0 = time.process_time()
                    direct_s.append(asyncio.run(direct_round(urls, prompts[offset: offset + args.groups],
                                                             args.n, sampling)))
                    direct_cpu += time.process_time() - c0
                    offset += args.groups
                else:
                    c0 = _cpu_s(svc.pid)
                    service_s.append(service_round(url, args.groups))
                    svc_cpu += _cpu_s(svc.pid) - c0
            print(f"round {r}: direct {args.groups / direct_s[-1]:.2f} groups/s, "
                  f"service {args.groups / service_s[-1]:.2f} groups/s", flush=True)
        d = args.groups / statistics.median(direct_s)
        s = args.groups / statistics.median(service_s)
        result = {"bench": "rollout", "preset": args.preset, "engines": args.engines, "groups": args.groups,
                  "n": args.n, "new_tokens": args.new_tokens, "direct_groups_per_s": round(d, 3),
                  "service_groups_per_s": round(s, 3), "ratio": round(s / d, 3),
                  "overhead": round(1 - s / d, 3), "target_overhead": 0.10, "meets_target": 1 - s / d <= 0.10,
                  "client_cpu_s_per_group": {"direct": round(direct_cpu / (args.groups * args.rounds), 4),
                                             "service": round(svc_cpu / (args.groups * args.rounds), 4)}}
        print(json.dumps(result))
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    main()
