"""Rollout service overhead: groups/s through the service vs the same requests straight to the engines.

One run starts a buffer (``--memory``) and ``--engines`` reference engines as real processes, then
alternates two ways of producing the same work (``--groups`` groups x ``--n`` samples of
``--new-tokens`` tokens, EOS ignored so every sequence has the same length):

- direct: this process tokenizes the prompts and sends every /generate straight to the engines
  (round-robin, all concurrently, return_logprob on), nothing else: one request per sequence, and
  ``direct_batched``: batch requests of ``--direct-batch`` sequences (what the service's
  transport sends when it coalesces); through the service's own engine client
  (``shared.eager_http``, orjson; until 5 Dec, seventeenth session, ``shared.aio.AioHTTP``), its
  connections kept from round to round as the service keeps its own (until then each round
  opened new ones in a new event loop, inside the timed part), so that only the service differs;
- service: ``headrace rollout serve`` attached to the same engines (backend external, on_demand)
  answers ``POST /v1/generate_batch`` — routing, logprobs, reward (exact_match), group validation
  and the push to the buffer included.

    python bench/rollout_bench.py [--preset tiny-qwen2] [--engines 1] [--groups 32] [--n 8] [--new-tokens 16]

Prints groups/s of each (medians over ``--rounds``), the ratio service / the faster direct way and
the overhead (target: overhead <= 10%), the service against single requests, and the CPU each
process used in each kind of round (``cpu_ms_per_round``: buffer, engines, rollout service, this
process; from ``/proc/<pid>/task/*/schedstat``, nanoseconds): CPU is far less noisy here than
wall time, so a change to the service is best judged by its CPU per round first. The service
shares the CPU with the engines here; on 2 cores that contention is part of what is measured. The service is called through the trainer's own client
(``RolloutClient``, one connection for every round); before 3 Dec each round made a new httpx
client, 50-80 ms of this process's time charged to the service alone.

Measured 3 Dec (2 engines, defaults; load ~1): 0.82, 0.87, 0.83, 0.84, 0.81 (until then
0.69-0.78, ~0.05-0.08 of it that client). Traced per round (~0.3 s): ~19 ms from the request to
the first ``/generate`` (preparing 256 sequences: 32 groups' prompts and samples), the engines'
batches (every round 4 requests of 32 sequences per engine on both paths; the two engines finish
up to 40-90 ms apart on both paths), then 22-28 ms from the last answer to the last push (the
answered groups' samples, rewards, columns and the buffer's commit, ~2 ms of CPU per group).
Sending each batch as soon as it is full instead of once all are prepared staggers the engines'
admission and made the ratio worse (0.64).

3 Dec, later: the service's engine requests moved from httpx to aiohttp (~0.7 ms of CPU per
request against 2-3 ms), and this bench's direct paths with them (until then they used httpx with
the fleet's settings and the stdlib's JSON). The service's CPU per group fell from ~2.7 to ~2.1 ms
but its rounds did not get shorter, while the direct paths' did: ratio 0.79, 0.78, 0.81, 0.83;
with a group's samples sharing one engine 0.82, 0.86, 0.81, 0.81, 0.83, 0.77, 0.81. A round is the
engines' batches, which share the 2 cores with the service, plus the service's serial part
(13-25 ms before the first send, 20-30 ms after the last answer), not its CPU throughput.

3 Dec evening (20 rounds): 0.899, 0.87, 0.848, 0.874, 0.856, 0.858. Traced: 10-16 ms before the first
send (1.3-7 ms of it the engines' version read), ~10 ms after the last answer; overlapping the
version read with the preparation measured no difference. The two engines alone, called straight
with identical rounds, take 225-385 ms a round, and in one service round the engines' 15 decode
steps of 128 sequences took ~9-10 ms each on one and ~12.5 ms on the other: the ratio's spread is
mostly the engines sharing the 2 cores.

4 Dec: the service's CPU per short answer cut: engine answers of at most 128 tokens are checked in
plain Python when they are plainly valid (22 -> 4 us for 16 tokens; numpy's fixed cost dominated),
a reward function that answers at once is applied inline instead of through a task per sample,
and a group's samples are renumbered only where they differ. fleet_sim at 16 tokens, 2 engines,
service CPU per group in alternating runs: 0.86 / 0.73 / 0.63 ms after against 0.85 / 1.14 / 0.92
ms before. This script (20 rounds), all runs of the day: with the old code 0.827, 0.894, 0.79,
0.841, 0.86, 0.838, 0.854, 0.882, 0.819, 0.833 (median 0.840); with the changes 0.879, 0.852, 0.884
(the first two), then 0.906, 0.857, 0.926, 0.924, 0.971, 0.921, 0.815, 0.821, 0.85, 0.767, 0.872,
0.884, 0.904, 0.907, 0.802 (all three: median 0.884, seven of fifteen at or above 0.90). In six
pairs of back-to-back runs (old, then new) the new minus the old was +0.06, -0.02, -0.03, +0.02,
+0.09, -0.03: the gain is not shown beyond this machine's noise, and the target is still missed.

4 Dec, ninth session. Traced rounds were ~150-175 ms: 1.2-4.9 ms reading the engines' weight
version, ~3.5-6.5 ms preparing the 32 groups (tokenizing, prompt samples, a task per sample),
~3 ms routing and queueing the 256 sequences, ~6-9 ms from the last answer to the last push. Three
changes, each measured in back-to-back pairs (old, new; ratios):
- the service rounds name the weight version (``--ask-engines``: as before), as the trainer now
  does once it has synced the engines: 0.861/0.869, 0.889/0.91, 0.889/0.966, 0.855/0.91, 0.891/0.905;
- the default generator's group as one call (``EngineClient.generate_group``: no task per sample,
  the group's first requests routed and queued together): 0.877/0.903, 0.875/0.89, 0.905/0.899,
  0.876/0.939, 0.891/0.903;
- each sample of such a group one model copy of the prompt sample (no copy for the generator, no
  appending attribute by attribute): 0.894/0.937, 0.912/0.911, 0.918/0.925, 0.876/0.873, 0.898/0.925.
Service CPU per 16-token group (fleet_sim, 2 engines, under cProfile) fell ~15% with the second.

5 Dec, sixteenth session. ``--direct-batch`` now also sets the service's ``engines.coalesce_max``
(default: that setting's default), so both sides send the same batches. Traced from inside (the
bench, the service and both engines stamping one clock), a round's medians in ms from the
bench's call: the service has the request at 1.2, its last /generate leaves at 3.8, the engines
finish their batches at 85.7 and 90.0, the service has read the last answer at 96.6 (the engine
renders and sends 128 answers; the service may still be building the first engine's groups), the
last group is built at 100.1, the buffer has the last POST (16 groups) stored at 102.2 and the
bench has the answer at 103.1. The direct round reads its answers ~2 ms after the engines finish.
Found and changed:
- every server (engines, buffer, rollout service; ``shared.serving.serve``) and this script now
  freeze their startup heap (``gc.freeze``): the engines had a 95-140 ms full collection about
  every 1.5 s, this process one of ~100 ms as often, in whichever round it fell;
- the rollout service's pushes go through ``shared.eager_http`` (a fraction of aiohttp's CPU per
  request) and ``push`` posts 8 queued groups at once, written before it returns, so the buffer
  stores them while the service builds the rest (``rollout/pusher.py``);
- ``engines.coalesce_max`` 128 instead of 32 (one batch per engine a round) was measured and its
  default left at 32: its gain is within this script's noise, and a vLLM rollout test's
  pause/resume race failed once under it in CI.
Alternating runs, medians: first attempts through eager_http 0.887-0.898 against 0.874-0.879;
posting at 8 queued groups 0.888 against 0.882; coalesce_max 128 0.900 against 0.884 (6 pairs);
all three against none (with --direct-batch 32): 0.890 against 0.879 (6 pairs, 4 better). Tried
and dropped: httptools (0.884 against 0.887), the engines' /generate through eager_http (0.878
against 0.890: no gain). Single runs range ~0.86-0.93 with the same code: the target (0.90) is
still missed in the median.

5 Dec, seventeenth session. The direct paths now use the service's engine client (which became
``shared.eager_http``: by this script's CPU meter 11.2-12.0 ms of service CPU a round against
12.4-13.4 with aiohttp, so the ratio's noise had hidden it) and keep their connections across
rounds; before, each direct round opened new aiohttp connections in a new event loop inside its
timed part, a handicap the service never had. The same code measures ~0.015 lower against this
stricter baseline: eight runs 0.868-0.912, median 0.8845; the previous script against it: median
0.899 of six (against the sixteenth session's code 0.8845). Traced on one clock: the engines' last
request is read ~5 ms after the call (direct: 1.5 ms), then the engines hold 20 ms for more and run
~62 ms alike; from their last answer to the client's answer ~11 ms (direct: 0.6 ms), the service
building the groups at ~0.23 ms each as the answers come, the last POST ~1.2 ms, the answer to the
client ~0.9 ms. bench/RESULTS.md has the changes and what was dropped.

6 Dec, eighteenth session. Traced again (the service's and the engines' events on one clock, and
py-spy of the service, the buffer and an engine): the engines take ~6 ms from their first finished
sequence to their last answer on both paths (the answers' rendering); on the service path the
service's group building and the buffer's POSTs run in that same phase, so it is CPU-bound on the
2 cores (engines ~12 ms + service ~8 ms + buffer ~4 ms), and py-spy found the service waiting for
a core ~25% of its active time. Changes: a round's groups go as one POST once the last is built
(``rollout/pusher.py``: the loop flushes when no group is left in production; before, 5-6 POSTs of
~8 groups competed with the engines), the buffer's in-memory store runs on its event loop (two
thread hand-offs less per POST), the data cursor is not written while a round runs (~0.5 ms a
round), a group's samples are cloned without pydantic's copy. By this script's CPU meter: service
10.1-11.6 ms a round (was 12.2-13.7), buffer 2.6-2.9 ms (was 6.1-7.3). Ratio, twelve runs: 0.887,
0.88, 0.873, 0.886, 0.888, 0.886, 0.917, 0.879, 0.904, 0.903, 0.898, 0.883, median 0.8865 (the previous code's runs of the same
morning: 0.875, 0.873, 0.9, 0.879, 0.874, 0.848, 0.879, median ~0.876). Same-run A/B of alternate
rounds (a tracer flipping the policy each round): the one POST shortened the service's round by
0.7 and 2.2 ms. Measured and dropped: writing each engine batch when it fills (the last request
leaves no earlier: the engines reading the first batches slow the preparation of the rest), the
group's samples cloned 2 or 10 ms after its requests left instead of after the answers (no gain
in alternate rounds), at most one POST in flight (no gain).

6 Dec, nineteenth session: target met. This process's call was traced too: from ``RolloutClient``'s
call to the service starting the round and from the round's end to the call's return took ~2.1 ms a
round, ~0.7 ms of it httpx's own work here and ~0.2 ms FastAPI's machinery in the service. The
client now speaks ``http.client`` to a plain-http service and ``/v1/generate_batch`` is a plain
Starlette route (~1.2 ms left; this process's CPU per service round 1.4-1.5 -> 0.7-0.8 ms); the
service makes the next round's prompt ids while a round's requests are out (the engines' last
request ~0.7 ms earlier), builds a group's samples in one pass and checks a batch answer with
numpy reductions. Sixteen runs: median 0.910 (0.893-0.950, fifteen at or above 0.90).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402
import yaml  # noqa: E402

from headrace.shared.eager_http import EagerHTTP  # noqa: E402
from headrace.shared.rollout_client import RolloutClient  # noqa: E402
from tests.procs import Proc, child_env, free_port, headrace_cmd  # noqa: E402


class Direct:
    """Straight to the engines, with the service's own HTTP client for them (rollout/transport.py:
    ``shared.eager_http``, orjson), its connections kept from round to round as the service keeps
    its own: only the service differs. One event loop for every round."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.loop = asyncio.new_event_loop()
        self.clients = [EagerHTTP(u) for u in urls]

    def round(self, prompts: list[list[int]], n: int, sampling: dict, batch: int = 1) -> float:
        """Every sequence at once: one request each (``batch`` 1) or in batch requests of ``batch``
        sequences (what the service's transport does with coalescing); seconds until all answered."""
        return self.loop.run_until_complete(self._round(prompts, n, sampling, batch))

    async def _round(self, prompts: list[list[int]], n: int, sampling: dict, batch: int) -> float:
        seqs = [p for p in prompts for _ in range(n)]
        chunks = [seqs[i:i + batch] for i in range(0, len(seqs), batch)]

        async def one(i: int, chunk: list[list[int]]) -> None:
            body = orjson.dumps({"input_ids": chunk if batch > 1 else chunk[0], "sampling_params": sampling,
                                 "return_logprob": True})
            r = await self.clients[i % len(self.clients)].post("/generate", body, {"content-type": "application/json"},
                                                               600.0)
            assert r.status_code == 200, r.text[:500]
            outs = orjson.loads(r.content)
            for out in outs if batch > 1 else [outs]:
                assert len(out["output_ids"]) == sampling["max_new_tokens"], out["meta_info"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, c) for i, c in enumerate(chunks)))
        return time.perf_counter() - t0

    def close(self) -> None:
        for c in self.clients:
            self.loop.run_until_complete(c.close())
        self.loop.close()


def service_round(client: RolloutClient, groups: int, version: int | None) -> float:
    """One ``generate_batch`` through the trainer's own client (persistent connection: creating an
    httpx client costs 50-80 ms here, which a round must not pay when the trainer does not),
    naming the weight version as the trainer does once it has synced the engines (``version``
    None: the service asks every engine, as at a trainer's first step)."""
    t0 = time.perf_counter()
    got = client.generate_batch(groups, version)
    dt = time.perf_counter() - t0
    assert got["groups"] == groups, got
    return dt


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has run, all its threads (Linux ``/proc/<pid>/task/*/schedstat``:
    nanoseconds; ``/proc/<pid>/stat`` counts 10 ms ticks, too coarse for a ~100 ms round)."""
    import os

    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):   # a thread that ended meanwhile
            pass
    return total / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-qwen2")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--ask-engines", action="store_true",
                    help="service rounds name no weight version: the service reads it from every engine")
    ap.add_argument("--direct-batch", type=int, default=None,
                    help="sequences per request of the batched direct baseline and the service's "
                         "engines.coalesce_max (default: that setting's default)")
    args = ap.parse_args()
    if args.direct_batch is None:
        from headrace.shared.config_sections import EnginesConfig
        args.direct_batch = EnginesConfig.model_fields["coalesce_max"].default

    from headrace.shared.modelzoo import init_model, load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    model = init_model(args.preset, tmp / "model")
    tok = load_tokenizer(model)
    total_prompts = args.groups * (2 * args.rounds + 3)
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
            "rollout": {"engines": {"backend": "external", "urls": urls, "coalesce_max": args.direct_batch},
                        "mode": "on_demand",
                        "data": {"path": str(data), "shuffle": False}, "n_samples_per_prompt": args.n,
                        "max_concurrency": args.groups * args.n, "reward": "exact_match",
                        "sampling": {k: v for k, v in sampling.items()}},
            "run": {"out": str(tmp / "run")}}))
        svc = Proc(headrace_cmd("rollout", "serve", "--config", str(cfg), "--port", str(rport)), tmp / "rollout.log",
                   env=child_env(HEADRACE_LOG_LEVEL="WARNING"))
        procs.append(svc)
        url = f"http://127.0.0.1:{rport}"
        svc.wait_http(f"{url}/health", timeout=120)
        rollout = RolloutClient(url, timeout=900.0)

        # warm-up every path (engine caches, connection pools, first-call imports)
        direct = Direct(urls)
        direct.round(prompts[: args.groups], args.n, sampling)
        direct.round(prompts[: args.groups], args.n, sampling, args.direct_batch)
        version = None if args.ask_engines else 0   # what the engines serve: the trainer knows it
        # this process's heap so far (torch, transformers, the tokenizer) out of the cyclic GC's walks,
        # as the services do (shared.serving): a full collection here took ~100 ms, in whichever round
        gc.collect()
        gc.freeze()
        service_round(rollout, args.groups, version)
        times: dict[str, list[float]] = {"direct": [], "direct_batched": [], "service": []}
        # CPU of every process in each kind of round: buffer, engines, rollout service, this process
        cpu = {k: [0.0] * (len(procs) + 1) for k in times}
        offset = args.groups
        order = list(times)
        for r in range(args.rounds):  # rotate the order so drifting background load hits all alike
            for which in order[r % 3:] + order[:r % 3]:
                c0 = [cpu_seconds(p.pid) for p in procs] + [time.process_time()]
                if which == "service":
                    times[which].append(service_round(rollout, args.groups, version))
                else:
                    batch = args.direct_batch if which == "direct_batched" else 1
                    times[which].append(direct.round(prompts[offset: offset + args.groups], args.n, sampling, batch))
                    offset += args.groups
                c1 = [cpu_seconds(p.pid) for p in procs] + [time.process_time()]
                cpu[which] = [a + b1 - b0 for a, b0, b1 in zip(cpu[which], c0, c1)]
            print(f"round {r}: " + ", ".join(f"{k} {args.groups / v[-1]:.2f}" for k, v in times.items())
                  + " groups/s", flush=True)
        per_round = {k: [round(1000 * x / args.rounds, 1) for x in v] for k, v in cpu.items()}
        cpu_ms = {k: {"buffer": v[0], "engines": v[1:-2], "service": v[-2], "this_process": v[-1]}
                  for k, v in per_round.items()}
        rate = {k: args.groups / statistics.median(v) for k, v in times.items()}
        d = max(rate["direct"], rate["direct_batched"])    # the better way of calling the engines directly
        s = rate["service"]
        result = {"bench": "rollout", "preset": args.preset, "engines": args.engines, "groups": args.groups,
                  "n": args.n, "new_tokens": args.new_tokens,
                  "direct_groups_per_s": round(rate["direct"], 3),
                  "direct_batched_groups_per_s": round(rate["direct_batched"], 3),
                  "service_groups_per_s": round(s, 3), "ratio": round(s / d, 3),
                  "overhead": round(1 - s / d, 3), "target_overhead": 0.10, "meets_target": 1 - s / d <= 0.10,
                  "ratio_vs_single_requests": round(s / rate["direct"], 3),
                  "client_cpu_s_per_group": {k: round(v[-2 if k == "service" else -1] / (args.groups * args.rounds), 4)
                                             for k, v in cpu.items()},
                  "cpu_ms_per_round": cpu_ms}
        print(json.dumps(result))
        rollout.close()
        direct.close()
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    main()
