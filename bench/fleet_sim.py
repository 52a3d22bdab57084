"""How many groups/s one rollout service drives, and one buffer ingests, against simulated engines.

DESIGN.md "Columnar wire format and scale-out". No model runs: one process (``--serve-engines``)
listens on as many ports as the largest engine count and answers SGLang's ``/generate`` at once
with the requested number of tokens (ids spread over ``--vocab``) and per-token logprobs, in
SGLang's answer shape (``{"text", "output_ids", "meta_info": {"finish_reason",
"output_token_logprobs": [[lp, id, null], ...], ...}}``, a list for a batch request), plus the routes a fleet touches at start (``/health``,
``/get_model_info``, ``/get_server_info``, ``/get_weight_version``, pause / continue / abort).
Answers are built from bytes prepared once per token count, so the engines cost little CPU (the
bench prints theirs: they must not be the bottleneck).

(a) rollout service: a real ``headrace rollout serve`` (backend external, on_demand) attached to E
    simulated engines, pushing into a real ``headrace buffer serve --memory``, answers
    ``POST /v1/generate_batch {"groups": G}``; the rate is groups / wall time of a batch (median of
    ``--rounds``; G is what the warm-up's rate makes in ``--round-s``, at most ``--groups``), for
    each E in ``--engines``. CPU per group of the service is printed too: on a loaded machine the
    wall-time rate understates what the service would do with a core of its own. ``--services k``
    runs k services instead (scale-out, as ``run.rollout_services``: engine blocks, prompt shards,
    every round split over them by engines) and prints their rate together;
(b) buffer: ``--producers`` processes post pre-encoded columnar bodies (``--push-batch`` groups
    each, fresh ids every time) to one buffer (durable SQLite, or ``--buffer-memory``) for
    ``--buffer-seconds``; the rate is groups accepted / seconds.

Each figure is also given as GPUs served at ``--gpu-tokens-per-s`` (5,000) per GPU, with groups of
``--n`` x ``--new-tokens`` (8 x 2,048) tokens: G = groups/s x n x new_tokens / gpu_tokens_per_s.

3 Dec evening: 8 engines 213-239 GPUs (13.2-14.3 ms of service CPU per group), and 421 / 429 / 406
GPUs with 8 / 32 / 128 engines (7.6-7.9 ms) in a fast hour of the host. Parsing the logprob
triples with numpy (``np.fromstring`` on the bracket-stripped text) was 2x slower than orjson.
3 Dec night: 308 / 328 / 316 GPUs (9.8-10.9 ms per group). The floor of this format: orjson's parse of
one group's answers (534 KB) takes 1.44 ms with the GC off and freeing them 0.93 ms, 2.4 ms of the
3.3 ms that 1,000 GPUs allow; flattening the triples with ``bytes.replace`` first saved 0.26 ms and
cost 0.97 ms. 4 Dec: 408 / 393 / 426 GPUs (7.7-8.0 ms per group), buffer 3,595 GPUs (1,097 groups/s);
at 16 tokens with 2 engines 0.63 ms of service CPU per group. 4 Dec, ninth session (a default-generator
group as one call, one sample copy each): 0.44 ms at 16 tokens; 453 / 467 / 446 GPUs at 2,048 (the
per-token work did not change). 5 Dec, twelfth session (the push encodes the arrays ``check_answer``
made, ``columns_push.Packed``): 659 / 668 / 619 GPUs (4.8-5.3 ms per group, was 6.1-6.2); ``--services 2``
1,026 GPUs with 8 engines. Until then the answers' token ids were 5..54, which Python shares as
objects; since, they spread over ``--vocab`` ids (150,000): 504 / 495 / 496 GPUs (6.4-6.7 ms per group;
8.1 ms before the change), ``--services 2`` 737. 5 Dec, fifteenth session: the service reads long
answers with simdjson (``rollout/fast_answers.py``: the triples become one flat array of numbers in
the bytes, no Python object per token): 1,048-1,124 GPUs (3.0-3.1 ms per group) against 616-646
(5.05-5.23 ms) with it turned off (``HEADRACE_FAST_ANSWERS_MIN_BYTES`` huge), in alternating runs.
bench/RESULTS.md has every run and profile.

    python bench/fleet_sim.py [--engines 8,32,128] [--services 1] [--groups 256] [--rounds 3]
                              [--new-tokens 2048] [--producers 4] [--buffer-seconds 6] [--profile OUT.prof]

prints (besides ``#`` lines of detail: CPU per group of the service, the buffer and the engines,
and the rate each would reach with a core of its own, 1 / CPU per group)
    rollout service: N groups/s with E engines = G GPUs      (k rollout services: ..., with --services k)
    buffer: N groups/s from P producers = G GPUs
``--profile`` runs the rollout service of the first engine count under cProfile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402

GPU_TOKENS_PER_S = 5000.0
VOCAB = 150_000   # token ids of the simulated answers: as many distinct ids as a real vocabulary

# ---- the simulated engines --------------------------------------------------------------------


def _answer_parts(new_tokens: int, vocab: int) -> tuple[bytes, bytes]:
    """One sequence's answer as (bytes before the prompt length, bytes after it); token ids spread
    over [0, vocab)."""
    ids = [(5 + k * 7919) % vocab for k in range(new_tokens)]
    # float32 logprobs as SGLang returns them (its tensors are float32): ~18 characters each
    import numpy as np

    lps = (-np.abs(np.sin(np.arange(new_tokens, dtype=np.float64) * 1.7)) * 3.0 - 1e-4).astype(np.float32).tolist()
    head = orjson.dumps({"text": "7", "output_ids": ids, "meta_info": {
        "id": "sim", "finish_reason": {"type": "length", "length": new_tokens}, "completion_tokens": new_tokens,
        "cached_tokens": 0, "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}})
    return head[:-2] + b',"prompt_tokens":', b"}}"


class _SimHTTP(asyncio.Protocol):
    """Minimal HTTP/1.1 keep-alive server: enough of SGLang's API for a fleet and /generate."""

    parts: dict[int, tuple[bytes, bytes]] = {}
    requests = 0
    vocab = VOCAB

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path = head[0].split(" ")[:2]
            self._answer(*self._route(method, path.split("?")[0], body))

    def _route(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/generate" and method == "POST":
            _SimHTTP.requests += 1
            req = orjson.loads(body)
            n = int(req.get("sampling_params", {}).get("max_new_tokens", 16))
            if n not in self.parts:
                self.parts[n] = _answer_parts(n, self.vocab)
            a, b = self.parts[n]
            ids = req["input_ids"]
            if ids and isinstance(ids[0], list):
                return 200, b"[" + b",".join(a + str(len(p)).encode() + b for p in ids) + b"]"
            return 200, a + str(len(ids)).encode() + b
        if path == "/get_server_info":
            return 200, b'{"tp_size":1,"pp_size":1}'
        if path == "/get_model_info":
            return 200, b'{"model_path":"sim","is_generation":true}'
        if path == "/get_weight_version":
            return 200, b'{"weight_version":0}'
        if path in ("/health", "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache"):
            return 200, b"{}"
        return 404, b'{"detail":"not simulated"}'

    def _answer(self, status: int, body: bytes) -> None:
        reason = b"OK" if status == 200 else b"Not Found"
        self.t.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                     % (status, reason, len(body)) + body)


async def _serve_engines(count: int, ports_file: Path, vocab: int) -> None:
    _SimHTTP.vocab = vocab
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_SimHTTP, "127.0.0.1", 0, backlog=1024) for _ in range(count)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    tmp = ports_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.rename(ports_file)
    await asyncio.Event().wait()


# ---- helpers ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gpus(groups_per_s: float, n: int, new_tokens: int, per_gpu: float) -> int:
    return round(groups_per_s * n * new_tokens / per_gpu)


def _wait_file(path: Path, proc: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.cmd} did not write {path}:\n{proc.log()[-3000:]}")
        time.sleep(0.05)
    return json.loads(path.read_text())


# ---- (a) the rollout service -----------------------------------------------------------------


def rollout_figure(args: argparse.Namespace, tmp: Path, model: Path, urls: list[str], sim_pid: int,
                   buffer_url: str, buffer_pid: int, data: Path, profile: str | None) -> tuple[float, dict[str, float]]:
    """(groups/s, details) of ``args.services`` rollout services driving ``urls`` together: service
    i gets the i-th contiguous block of the engines and shard i of the prompts, as ``headrace run``
    with ``run.rollout_services`` splits them, and each round asks every service for its share of
    the groups at once (one thread each); the rate is all groups / the round's wall time."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import yaml

    from headrace.deploy.plan import engine_blocks
    from headrace.shared.staleness import split_by_weights
    from tests.procs import Proc, child_env, free_port, headrace_cmd

    e, k = len(urls), args.services
    blocks = engine_blocks(e, k, "--engines")
    svcs, service_urls = [], []
    for i, block in enumerate(blocks):
        cfg = tmp / f"rollout-{e}-{i}.yaml"
        cfg.write_text(yaml.safe_dump({
            "model": str(model), "buffer": {"url": buffer_url, "max_staleness": 0, "capacity": 10_000_000},
            "rollout": {"engines": {"backend": "external", "urls": [urls[j] for j in block]}, "mode": "on_demand",
                        "data": {"path": str(data), "shuffle": False,
                                 **({"shard": {"index": i, "count": k}} if k > 1 else {})},
                        "n_samples_per_prompt": args.n, "groups_per_step": args.groups,
                        "max_concurrency": min(100_000, args.groups * args.n), "reward": "exact_match",
                        "state_path": str(tmp / f"rollout-{e}-state.json"),
                        "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}},
            "run": {"out": str(tmp / f"run-{e}")}}))
        port = free_port()
        argv = headrace_cmd("rollout", "serve", "--config", str(cfg), "--port", str(port))
        if profile and i == 0:  # the service exits with os._exit: its profile is dumped on SIGUSR1 instead
            argv = [argv[0], "-c", PROFILED, profile, *argv[3:]]
        svcs.append(Proc(argv, tmp / f"rollout-{e}-{i}.log", env=child_env(HEADRACE_LOG_LEVEL="WARNING")))
        service_urls.append(f"http://127.0.0.1:{port}")
    # one client per service for every round, as the trainer's (making one costs 50-80 ms)
    clients = [httpx.Client(timeout=900) for _ in svcs]
    pool = ThreadPoolExecutor(k)
    try:
        for svc, url in zip(svcs, service_urls):
            svc.wait_http(f"{url}/health", timeout=180)

        def one(i: int, groups: int) -> None:
            r = clients[i].post(f"{service_urls[i]}/v1/generate_batch", json={"groups": groups, "weight_version": 0})
            if r.status_code != 200 or r.json()["groups"] != groups:
                raise RuntimeError(f"generate_batch: {r.status_code} {r.text[:500]}\n{svcs[i].log()[-3000:]}")

        def batch(groups: int) -> float:
            shares = split_by_weights(groups, [len(b) for b in blocks])
            t0 = time.perf_counter()
            for f in [pool.submit(one, i, n) for i, n in enumerate(shares) if n]:
                f.result()
            return time.perf_counter() - t0

        warm = max(k, args.groups // 8)
        dt = batch(warm)  # warm-up: connections, first-call imports; sizes the rounds to ~round_s
        size = max(k, min(args.groups, int(warm / dt * args.round_s)))
        if profile:
            os.kill(svcs[0].pid, signal.SIGUSR2)

        def service_cpu() -> float:
            return sum(cpu_seconds(s.pid) for s in svcs)

        times, cpu_svc, cpu_sim, cpu_buf = [], 0.0, 0.0, 0.0
        for _ in range(args.rounds):
            c0, s0, b0 = service_cpu(), cpu_seconds(sim_pid), cpu_seconds(buffer_pid)
            times.append(batch(size))
            cpu_svc += service_cpu() - c0
            cpu_sim += cpu_seconds(sim_pid) - s0
            cpu_buf += cpu_seconds(buffer_pid) - b0
        rate = size / statistics.median(times)
        done = size * args.rounds
        return rate, {"groups_per_round": size, "service_cpu_ms_per_group": 1000 * cpu_svc / done,
                      "engines_cpu_ms_per_group": 1000 * cpu_sim / done,
                      "buffer_cpu_ms_per_group": 1000 * cpu_buf / done,
                      "service_cpu_share": cpu_svc / sum(times), "engines_cpu_share": cpu_sim / sum(times),
                      "buffer_cpu_share": cpu_buf / sum(times)}
    finally:
        pool.shutdown(wait=False)
        for c in clients:
            c.close()
        if profile and svcs[0].alive():
            os.kill(svcs[0].pid, signal.SIGUSR1)
            deadline = time.monotonic() + 30
            while not Path(profile).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        for svc in svcs:
            svc.stop(timeout=30)


PROFILED = ("import cProfile, signal, sys\n"   # SIGUSR2 starts profiling (after the warm-up), SIGUSR1 dumps
            "from headrace.deploy.cli import main\n"
            "out = sys.argv.pop(1)\n"
            "pr = cProfile.Profile()\n"
            "signal.signal(signal.SIGUSR2, lambda *a: pr.enable())\n"
            "signal.signal(signal.SIGUSR1, lambda *a: (pr.disable(), pr.dump_stats(out)))\n"
            "main()\n")


# ---- (b) the buffer --------------------------------------------------------------------------


def _template(batch: int, n: int, new_tokens: int, seed: int) -> Any:
    from headrace.shared import columns as cols
    from headrace.shared.schemas import Group, Sample

    prompt = list(range(3, 23))
    lps = [-0.25 - (k % 17) * 0.125 for k in range(new_tokens)]
    groups = [Group.model_construct(group_id=f"p{seed}-g{g}", metadata={}, samples=[
        Sample.model_construct(uid=f"p{seed}-g{g}-{i}", group_id=f"p{seed}-g{g}", index=i,
                               tokens=prompt + [5 + (k * 7) % 50 for k in range(new_tokens)],
                               response_length=new_tokens, loss_mask=[1] * new_tokens, rollout_logprobs=lps,
                               reward=float(i % 2), status="truncated", weight_version=0, prompt="sim",
                               response=None, label=None, metadata={}) for i in range(n)]) for g in range(batch)]
    return cols.from_rows(groups)


def producer(url: str, seed: int, seconds: float, batch: int, n: int, new_tokens: int) -> dict:
    """Build a template, say ``ready``, read the start time from stdin, then post fresh columnar
    bodies for ``seconds`` (at least one); the groups the buffer accepted."""
    import httpx

    from headrace.shared import columns as cols

    c = _template(batch, n, new_tokens, seed)
    accepted = posts = 0
    with httpx.Client(timeout=120.0) as http:
        print("ready", flush=True)
        start_at = float(sys.stdin.readline())
        while time.time() < start_at:
            time.sleep(0.002)
        t_end = start_at + seconds
        while posts == 0 or time.time() < t_end:
            gids = [f"p{seed}-r{posts}-g{g}" for g in range(batch)]
            c.group_id = gids
            c.uid = [f"{gid}-{i}" for gid in gids for i in range(n)]
            r = http.post(f"{url}/v1/groups", content=c.pack(), headers={"content-type": cols.COLUMNS})
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/groups: {r.status_code} {r.text[:300]}")
            accepted += r.json()["accepted"]
            posts += 1
    return {"accepted": accepted, "posts": posts, "elapsed": time.time() - start_at}


def buffer_figure(args: argparse.Namespace, tmp: Path) -> tuple[float, dict[str, float]]:
    from tests.procs import Proc, child_env, free_port, headrace_cmd

    port = free_port()
    store = ["--memory"] if args.buffer_memory else ["--db", str(tmp / "ingest.sqlite")]
    buf = Proc(headrace_cmd("buffer", "serve", "--port", str(port), *store, "--capacity", "10000000"),
               tmp / "ingest-buffer.log")
    url = f"http://127.0.0.1:{port}"
    procs = []
    try:
        buf.wait_http(f"{url}/health", timeout=60)
        for i in range(args.producers):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--producer", url, "--seed", str(i),
                 "--buffer-seconds", str(args.buffer_seconds), "--push-batch", str(args.push_batch),
                 "--n", str(args.n), "--new-tokens", str(args.new_tokens)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env()))
        for p in procs:   # all started and holding their template: start together
            assert p.stdout is not None and p.stdin is not None
            if p.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"a producer failed to start ({p.wait()})")
        start_at = time.time() + 0.2
        for p in procs:
            p.stdin.write(f"{start_at}\n".encode())
            p.stdin.flush()
        while time.time() < start_at:
            time.sleep(0.005)
        c0 = cpu_seconds(buf.pid)
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=args.buffer_seconds + 300)
            if p.returncode != 0:
                raise RuntimeError(f"a producer failed ({p.returncode}); buffer log:\n{buf.log()[-2000:]}")
            outs.append(json.loads(out.decode().strip().splitlines()[-1]))
        cpu = cpu_seconds(buf.pid) - c0
        elapsed = max(o["elapsed"] for o in outs)
        accepted = sum(o["accepted"] for o in outs)
        return accepted / elapsed, {"buffer_cpu_ms_per_group": 1000 * cpu / max(1, accepted),
                                    "buffer_cpu_share": cpu / elapsed, "posts": sum(o["posts"] for o in outs)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        buf.stop()


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="8,32,128", help="engine counts, comma-separated (0 or '' skips (a))")
    ap.add_argument("--services", type=int, default=1,
                    help="(a) with this many rollout services on one buffer, each with a block of the engines "
                         "and a shard of the prompts (as run.rollout_services); the rate is theirs together")
    ap.add_argument("--groups", type=int, default=512, help="most groups per generate_batch round")
    ap.add_argument("--round-s", type=float, default=6.0,
                    help="rounds hold as many groups as the warm-up rate makes in this long (at most --groups)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--new-tokens", type=int, default=2048, help="response tokens per sample")
    ap.add_argument("--producers", type=int, default=4, help="concurrent producers for (b); 0 skips (b)")
    ap.add_argument("--push-batch", type=int, default=16, help="groups per POST of a producer")
    ap.add_argument("--buffer-seconds", type=float, default=6.0)
    ap.add_argument("--buffer-memory", action="store_true", help="(b) against buffer --memory instead of SQLite")
    ap.add_argument("--gpu-tokens-per-s", type=float, default=GPU_TOKENS_PER_S)
    ap.add_argument("--vocab", type=int, default=VOCAB,
                    help="the simulated answers' token ids spread over [0, vocab) (until 5 Dec they were 5..54, "
                         "ids Python caches as objects: --vocab 55 gives that cost again)")
    ap.add_argument("--profile", default=None, help="cProfile output of the rollout service (first engine count)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, databases)")
    ap.add_argument("--preset", default="tiny-qwen2", help="model whose tokenizer the rollout service loads")
    ap.add_argument("--serve-engines", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ports-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--producer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_engines:
        asyncio.run(_serve_engines(args.serve_engines, Path(args.ports_file), args.vocab))
        return
    if args.producer:
        print(json.dumps(producer(args.producer, args.seed, args.buffer_seconds, args.push_batch,
                                  args.n, args.new_tokens)), flush=True)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    from headrace.shared.modelzoo import init_model
    from tests.procs import Proc, child_env, free_port, headrace_cmd

    counts = [int(x) for x in str(args.engines).split(",") if x.strip() and int(x) > 0]
    if args.services < 1 or any(c < args.services for c in counts):
        raise SystemExit(f"--services {args.services}: needs 1 <= services <= every engine count ({counts})")
    tmp = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    per = (args.n, args.new_tokens, args.gpu_tokens_per_s)
    procs: list[Any] = []
    try:
        if counts:
            model = init_model(args.preset, tmp / "model")
            data = tmp / "prompts.jsonl"
            need = (args.groups * (args.rounds + 1) * len(counts) + args.groups) * (2 if args.services > 1 else 1)
            data.write_text("".join(json.dumps({"prompt": f"{i % 89} + {i % 7} =", "label": "7"}) + "\n"
                                    for i in range(need)))
            ports_file = tmp / "ports.json"
            sim = Proc([sys.executable, __file__, "--serve-engines", str(max(counts)), "--ports-file", str(ports_file),
                        "--vocab", str(args.vocab)],
                       tmp / "sim-engines.log", env=child_env())
            procs.append(sim)
            urls = [f"http://127.0.0.1:{p}" for p in _wait_file(ports_file, sim)]
            bport = free_port()
            buf = Proc(headrace_cmd("buffer", "serve", "--port", str(bport), "--memory", "--capacity", "10000000"),
                       tmp / "buffer.log")
            procs.append(buf)
            buf.wait_http(f"http://127.0.0.1:{bport}/health", timeout=60)
            for k, e in enumerate(counts):
                rate, detail = rollout_figure(args, tmp, model, urls[:e], sim.pid, f"http://127.0.0.1:{bport}",
                                              buf.pid, data, args.profile if k == 0 else None)
                # each service with a core of its own: k / CPU per group of them all
                one_core = 1000 * args.services / max(detail["service_cpu_ms_per_group"], 1e-9)
                print("# " + json.dumps({"engines": e, "services": args.services,
                                         **{k2: round(v, 3) for k2, v in detail.items()},
                                         "groups_per_s_at_one_core_each": round(one_core, 1),
                                         "gpus_at_one_core_each": gpus(one_core, *per)}), flush=True)
                who = "rollout service" if args.services == 1 else f"{args.services} rollout services"
                print(f"{who}: {rate:.1f} groups/s with {e} engines = {gpus(rate, *per)} GPUs", flush=True)
        if args.producers > 0:
            rate, detail = buffer_figure(args, tmp)
            one_core = 1000 / max(detail["buffer_cpu_ms_per_group"], 1e-9)
            print("# " + json.dumps({"producers": args.producers, "memory": args.buffer_memory,
                                     **{k: round(v, 3) for k, v in detail.items()},
                                     "groups_per_s_at_one_core": round(one_core, 1),
                                     "gpus_at_one_core": gpus(one_core, *per)}), flush=True)
            print(f"buffer: {rate:.1f} groups/s from {args.producers} producers = {gpus(rate, *per)} GPUs", flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)   # the ingest database alone is hundreds of MB


if __name__ == "__main__":
    main()
