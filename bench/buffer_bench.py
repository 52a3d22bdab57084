"""Buffer benchmark (not a test): ingest throughput against a bare endpoint, and lease+ack latency.

In one run, on this machine:
  (a) a bare FastAPI/uvicorn endpoint that only reads the request body (same uvicorn settings);
  (b) `headrace buffer serve` (SQLite WAL file, ``--durability process_crash`` by default:
      synchronous=NORMAL; ``power_loss``: synchronous=FULL; ``--memory``: in memory): POST
      /v1/groups of the same groups as msgpack rows and as columns (``application/x-headrace-columns``),
      each compared with the bare endpoint receiving the same bodies; then lease + ack of 64 groups through
      ``shared.client.BufferClient``: as the trainer does it ("trainer batch": columns decoded and
      validated with numpy, then the checked batch arrays of ``trainer.batch_columns``), as the
      trainer did before ("trainer via models": columns -> ``Group`` models -> ``build_batch``),
      columns -> models alone, validated numpy columns only, validated msgpack rows (the former
      default), and the server alone (columns answer, not decoded).
Groups are 8 samples x 2,048 tokens (512 prompt + 1,536 response, with loss masks and rollout
logprobs), several groups per request, each request with fresh ids. Rounds alternate between the
servers so background load hits both alike; the medians are compared.

Targets (2-core dev machine): ingest with columns >= 60% of the bare endpoint's bytes/s; lease+ack
of 64 groups at the trainer (decoded, validated) < 100 ms median.

Measured 2026-12-02 on the loaded 2-core machine (load 5-14; medians, one run each):
  lease+ack at the trainer: "trainer batch" 355-470 ms vs "trainer via models" 1,205-2,121 ms (3.4-5.9x
  faster) with "server only" at 146-291 ms in the same runs; in process, building the batch from 64
  groups' columns takes ~10x less than building it from models, and packing it ~20x less.
  Ingest with columns: 0.32 (process_crash), 0.33 (power_loss), 0.38 (--memory) of the bare endpoint:
  even without a file the per-request CPU (decode + validate + one blob per group ~11 ms, SQLite
  copying 1 MB of blobs into its pages ~40 ms in process at that load) is what remains.

Measured 2026-12-02, quiet machine (load < 1), after three changes: lease answers written straight
from the stored blobs (``shared.column_blobs.pack_merged``), WAL checkpoints on the buffer's own
thread, and the lease phase leasing only groups stored as columns (before, the ingest rounds' row
blobs were leased first and converted, which the timed leases paid). Lease+ack at the trainer,
"trainer batch": 52 ms median (min 48, max 55; target < 100 ms: met); "columns" 48 ms; "server
only" 43 ms; "trainer via models" 422 ms. Ingest with columns: 0.44 of the bare endpoint (673
groups/s; target 0.60: missed); in process, 320 commits of 1 MB took 3.0 s with SQLite's inline
checkpoints and ~1.2 s without.

3 Dec evening: 0.39 (file), 0.32 (--memory). Per-thread CPU per 1 MB columns request, buffer vs bare:
the event loop ~5 ms (the body's receipt through h11 ~3 ms, as in the bare server, whose whole
process takes 3-4 ms), the parse thread ~2.4 ms, the store's thread ~2.3 ms even in memory.
Parsing on the loop (no thread hop) changed nothing. With ``httptools`` installed (uvicorn then uses
it for both servers) the buffer took 9.2-10 ms a request instead of 11-12.7 ms, but the bare
endpoint 2.1-2.9 ms: the ratio falls to ~0.25.

4 Dec: two changes to the buffer, each measured by timing a real ``headrace buffer serve`` from
inside (read / parse / post / whole request, 150 serial 1 MB column requests): (1) column bodies up
to 4 MiB are parsed on the event loop, not on a worker thread (the hand-offs cost more than the
~1 ms parse); (2) the buffer sets glibc's ``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD``
(``shared.serving.keep_freed_memory``): with glibc's defaults each MB body came from freshly
mapped, zero-filled pages, and reading the body took ~1.9 ms instead of ~0.9 ms. Together, per
request at the client: 7.8 and 8.5 ms before, 5.0 and 5.8 ms after (alternating runs). The bare
endpoint keeps glibc's defaults; given the same settings it took 1.19 ms a request instead of
1.77 ms. This script's ratio did not move, because the bare endpoint swung as much between runs:
0.36, 0.38, 0.32, 0.40 after against 0.39, 0.37, 0.32, 0.38 before (alternating runs), and 0.37,
0.41 later (181 and 191 MB/s, 1,422 and 1,496 groups/s, against the bare endpoint's 483 and 466).
What a 1 MB request costs inside the buffer now: reading the body ~0.7-0.9 ms, decoding and
validating the columns ~1.0 ms, the group commit ~1.7 ms wall (1.4 ms of CPU on the store's thread),
and routing, auth and the answer ~0.6 ms. SQLite alone spends ~0.8 ms per MB of blobs, even in
memory (0.97 ms against 0.18 ms for the same rows with 100-byte blobs).

5 Dec (eleventh session): the payloads left SQLite for append-only segment files
(``buffer/payloads.py``; one ``pwritev`` and a crc32 per blob): the store's part of a 1 MB request
0.7 ms instead of ~1.3. Pairs new / old, serially 0.47 / 0.46, 0.54 / 0.47, 0.49 / 0.40, 0.51 / 0.44;
from 4 producers 0.53 / 0.47, 0.54 / 0.48, 0.53 / 0.52, 0.62 / 0.50. A store keeping no payload
at all (a measurement hack) reached 0.57-0.61 serially and 0.61-0.73 from 4: what is left is the
buffer's Python around the bare endpoint's read. Writing the group blobs as pieces (no joined
bytes) was slower.

5 Dec (fourteenth session): computing the crc32s on a helper thread beside the ``pwritev`` cut the
store's part in process (0.37 against 0.49 ms) but not in the server (``put`` 0.378 against 0.345
ms; ratios new / old 0.54 / 0.55, 0.54 / 0.55, 0.55 / 0.57): dropped. Each run left its ~190 MB
directory behind, pages this machine keeps dirty and throttles further writes on. With fifteen of
them, runs measured 0.28-0.35, so the script now deletes its directory (``--keep`` keeps it).

5 Dec (fifteenth session): the payload checksums through ``isal``'s CRC-32 (zlib's values, 0.016
instead of 0.14 ms per MB) and POST /v1/groups called from the buffer's ASGI edge, past FastAPI's
middleware and router (a bare ASGI endpoint answers a 1 MB body in 0.616 ms where a bare FastAPI
one takes 0.665). Eight runs alternating with the code before, new / old medians: 0.64 / 0.565
serially, 0.625 / 0.53 from 4 producers (target met in the median; single runs 0.60-0.68 and
0.56-0.71).

    python bench/buffer_bench.py [--rounds 3] [--requests 12] [--groups-per-request 8] [--memory]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import Response

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from headrace.shared import columns  # noqa: E402
from headrace.shared.client import BufferClient  # noqa: E402
from tests.procs import Proc, child_env, free_port, headrace_cmd  # noqa: E402

PROMPT, RESPONSE, SAMPLES = 512, 1536, 8
VOCAB = 150_000


def bare_server(port: int) -> None:
    """The baseline: read the body, answer its size."""
    import uvicorn

    app = FastAPI()

    @app.post("/ingest")
    async def ingest(request: Request) -> Response:
        body = await request.body()
        return Response(b'{"bytes":%d}' % len(body), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def make_bodies(rng: np.random.Generator, tag: str, requests: int, per_request: int,
                as_columns: bool = False) -> list[bytes]:
    bodies = []
    for r in range(requests):
        groups = []
        for k in range(per_request):
            gid = f"{tag}-{r}-{k}"
            tokens = rng.integers(0, VOCAB, size=(SAMPLES, PROMPT + RESPONSE))
            tokens[:, :PROMPT] = tokens[0, :PROMPT]   # one prompt per group, as the trainer requires
            tokens = tokens.tolist()
            logprobs = (-rng.exponential(1.0, size=(SAMPLES, RESPONSE))).tolist()
            groups.append({"group_id": gid, "samples": [
                {"uid": f"{gid}/{i}", "group_id": gid, "index": i, "tokens": tokens[i], "response_length": RESPONSE,
                 "loss_mask": [1] * RESPONSE, "rollout_logprobs": logprobs[i], "reward": float(i % 2),
                 "weight_version": 0, "status": "completed"} for i in range(SAMPLES)]})
        bodies.append(columns.encode(groups) if as_columns else msgpack.packb({"groups": groups}))
    return bodies


def post_all(client: httpx.Client, url: str, bodies: list[bytes], ctype: str = "application/msgpack") -> float:
    """Send the bodies one after another; bytes per second."""
    t0 = time.perf_counter()
    for b in bodies:
        r = client.post(url, content=b, headers={"content-type": ctype})
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")
    return sum(map(len, bodies)) / (time.perf_counter() - t0)


def post_concurrent(clients: list[httpx.Client], url: str, bodies: list[bytes], ctype: str) -> float:
    """``post_all`` from ``len(clients)`` threads at once (each its own connection, body i from
    thread i % n): bytes per second over the whole of it."""
    from concurrent.futures import ThreadPoolExecutor

    n = len(clients)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda i: post_all(clients[i], url, bodies[i::n], ctype), range(n)))
    return sum(map(len, bodies)) / (time.perf_counter() - t0)


def codec_costs(rng: np.random.Generator, per_request: int, lease_groups: int, reps: int = 3) -> None:
    """In this process, back to back (so load hits both alike): what the buffer does with one
    request body and what the trainer does with one lease answer, rows vs columns; medians."""
    from headrace.buffer.ingest import parse_groups
    from headrace.shared.schemas import LeaseResponse

    def med(fn: Any) -> float:
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs) * 1000

    rows_body = make_bodies(rng, "codec", 1, per_request)[0]
    cols_body = make_bodies(rng, "codec", 1, per_request, True)[0]
    r_ms = med(lambda: parse_groups(rows_body, "application/msgpack"))
    c_ms = med(lambda: parse_groups(cols_body, columns.COLUMNS))
    print(f"ingest parse of one request ({per_request} groups), in process: rows {r_ms:.1f} ms, columns {c_ms:.1f} ms "
          f"({r_ms / c_ms:.1f}x)")
    groups = [g for b in make_bodies(rng, "lease", -(-lease_groups // per_request), per_request)
              for g in msgpack.unpackb(b)["groups"]][:lease_groups]
    rows_answer = msgpack.packb({"lease_id": "x", "groups": groups, "expires_at": 0.0})
    cols_answer = columns.from_rows(groups).pack({"lease_id": "x", "expires_at": 0.0})
    extra = ("lease_id", "expires_at")
    r_ms = med(lambda: LeaseResponse.model_validate(msgpack.unpackb(rows_answer)))
    c_ms = med(lambda: columns.decode(cols_answer, extra))
    m_ms = med(lambda: columns.decode(cols_answer, extra)[0].to_groups())
    print(f"lease answer of {lease_groups} groups decoded + validated, in process: rows -> models {r_ms:.0f} ms, "
          f"columns {c_ms:.0f} ms ({r_ms / c_ms:.0f}x), columns -> models {m_ms:.0f} ms ({r_ms / m_ms:.1f}x)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=12, help="requests per round")
    ap.add_argument("--groups-per-request", type=int, default=8)
    ap.add_argument("--lease-groups", type=int, default=64)
    ap.add_argument("--lease-reps", type=int, default=3, help="lease+ack repetitions per mode")
    ap.add_argument("--memory", action="store_true",
                    help="buffer with --memory (no fsync): what the ingest path costs without the disk")
    ap.add_argument("--durability", choices=("process_crash", "power_loss"), default="process_crash",
                    help="buffer.durability of the file store (power_loss: an fsync per commit)")
    ap.add_argument("--producers", type=int, default=1,
                    help="ingest from this many concurrent connections too (columns only; 1: serial alone)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (database, logs)")
    ap.add_argument("--bare-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server:
        bare_server(args.bare_server)
        return 0

    rng = np.random.default_rng(0)
    codec_costs(rng, args.groups_per_request, args.lease_groups)
    tmp = Path(tempfile.mkdtemp(prefix="buffer-bench-"))
    bare_port, buf_port = free_port(), free_port()
    bare = Proc([sys.executable, __file__, "--bare-server", str(bare_port)], tmp / "bare.log", env=child_env())
    store = ["--memory"] if args.memory else ["--db", str(tmp / "bench.sqlite"), "--durability", args.durability]
    buf = Proc(headrace_cmd("buffer", "serve", "--port", str(buf_port), *store,
                            "--capacity", "1000000", "--max-body-mb", "512"), tmp / "buffer.log", env=child_env())
    bare_url, buf_url = f"http://127.0.0.1:{bare_port}", f"http://127.0.0.1:{buf_port}"
    try:
        bare.wait_http(bare_url + "/health")
        buf.wait_http(buf_url + "/health")
        print(f"building {args.rounds} x {args.requests} requests of {args.groups_per_request} groups "
              f"({SAMPLES} samples x {PROMPT + RESPONSE} tokens) ...", flush=True)
        warm = make_bodies(rng, "warm", 2, args.groups_per_request)
        rounds = [make_bodies(rng, f"r{i}", args.requests, args.groups_per_request) for i in range(args.rounds)]
        crounds = [make_bodies(rng, f"c{i}", args.requests, args.groups_per_request, True) for i in range(args.rounds)]
        print(f"request body {len(rounds[0][0]) / 1e6:.2f} MB as msgpack rows, {len(crounds[0][0]) / 1e6:.2f} MB "
              f"as columns", flush=True)
        rates: dict[str, list[float]] = {k: [] for k in ("bare rows", "rows", "bare columns", "columns")}
        with httpx.Client(timeout=120) as c:
            post_all(c, bare_url + "/ingest", warm)
            post_all(c, buf_url + "/v1/groups", warm)
            for bodies, cbodies in zip(rounds, crounds):
                rates["bare rows"].append(post_all(c, bare_url + "/ingest", bodies))
                rates["rows"].append(post_all(c, buf_url + "/v1/groups", bodies))
                rates["bare columns"].append(post_all(c, bare_url + "/ingest", cbodies, columns.COLUMNS))
                rates["columns"].append(post_all(c, buf_url + "/v1/groups", cbodies, columns.COLUMNS))
            if args.producers > 1:   # fresh column bodies (new ids), posted by several producers at once
                conc = [httpx.Client(timeout=120) for _ in range(args.producers)]
                try:
                    rates[f"bare x{args.producers}"], rates[f"columns x{args.producers}"] = [], []
                    for i in range(args.rounds):
                        fresh = make_bodies(rng, f"p{i}", args.requests, args.groups_per_request, True)
                        rates[f"bare x{args.producers}"].append(post_concurrent(conc, bare_url + "/ingest", fresh,
                                                                                 columns.COLUMNS))
                        rates[f"columns x{args.producers}"].append(post_concurrent(conc, buf_url + "/v1/groups",
                                                                                    fresh, columns.COLUMNS))
                finally:
                    for x in conc:
                        x.close()
        mbs = {k: statistics.median(v) / 1e6 for k, v in rates.items()}
        for k, v in rates.items():
            print(f"{k:14s}: {mbs[k]:8.1f} MB/s  (rounds: {', '.join(f'{r / 1e6:.0f}' for r in v)})")
        for form, body in (("rows", rounds[0][0]), ("columns", crounds[0][0])):
            groups_s = mbs[form] * 1e6 / (len(body) / args.groups_per_request)
            print(f"ingest ratio, {form:7s}: {mbs[form] / mbs['bare ' + form]:.2f} of the bare endpoint, "
                  f"{groups_s:.0f} groups/s" + (" (target >= 0.60)" if form == "columns" else ""))
        if args.producers > 1:
            k = args.producers
            print(f"ingest ratio, columns from {k} producers at once: {mbs[f'columns x{k}'] / mbs[f'bare x{k}']:.2f} "
                  f"of the bare endpoint from {k} ({mbs[f'columns x{k}']:.0f} against {mbs[f'bare x{k}']:.0f} MB/s)")

        # lease + ack: as the trainer does it (validated models), trusting the buffer (validate=False),
        # and the server alone (answer bytes not decoded); alternating, fresh groups each time
        from headrace.trainer.batch import build_batch
        from headrace.trainer.batch_columns import build_batch_columns

        modes = ("trainer batch", "trainer via models", "columns -> models", "columns", "rows validated", "server only")
        need = args.lease_groups * args.lease_reps * len(modes)
        with BufferClient(buf_url) as client, BufferClient(buf_url, columns=False) as rows_client, \
                httpx.Client(timeout=120) as raw:
            # the ingest rounds left groups queued, half of them stored as msgpack rows: a lease of
            # those converts rows to columns (what a buffer holding rows from older clients does),
            # so drain them untimed and lease only groups the trainer's way of posting stored
            while (queued := client.stats().queued) > 0:
                got = client.lease_columns(min(queued, 256), lease_s=60)
                assert got is not None
                client.ack(got.lease_id)
            extra = make_bodies(rng, "lease", -(-need // args.groups_per_request), args.groups_per_request, True)
            post_all(raw, buf_url + "/v1/groups", extra, columns.COLUMNS)
            lat: dict[str, list[float]] = {m: [] for m in modes}
            # two phases, modes alternating within each: the row modes make millions of Python objects
            # in both processes (pydantic models here, row maps in the buffer), whose collection may
            # land in whichever request comes next; a trainer on columns never makes them
            phases = (("trainer batch", "columns", "server only"), ("trainer via models", "columns -> models", "rows validated"))
            for phase in phases:
                for _ in range(args.lease_reps):
                    for mode in phase:
                        t0 = time.perf_counter()
                        if mode == "server only":
                            r = raw.post(buf_url + "/v1/leases", json={"groups": args.lease_groups, "lease_s": 60},
                                         headers={"accept": columns.COLUMNS})
                            assert r.status_code == 200
                            top = msgpack.unpackb(r.content, raw=False)
                            raw.post(f"{buf_url}/v1/leases/{top['lease_id']}/ack").raise_for_status()
                        elif mode in ("columns", "trainer batch"):
                            got = client.lease_columns(args.lease_groups, lease_s=60)
                            assert got is not None and got.num_groups == args.lease_groups
                            if mode == "trainer batch":   # what trainer.lease does: columns -> checked batch arrays
                                build_batch_columns(got.columns, vocab_size=VOCAB, max_seq_len=PROMPT + RESPONSE)
                            client.ack(got.lease_id)
                        else:
                            c = rows_client if mode == "rows validated" else client
                            got = c.lease(args.lease_groups, lease_s=60, validate=True)
                            assert got is not None and len(got.groups) == args.lease_groups
                            if mode == "trainer via models":   # the trainer before it consumed columns
                                build_batch(got.groups, vocab_size=VOCAB, max_seq_len=PROMPT + RESPONSE)
                            c.ack(got.lease_id)
                        lat[mode].append(time.perf_counter() - t0)
        for mode in modes:
            xs = lat[mode]
            print(f"lease+ack of {args.lease_groups} groups, {mode:16s}: median {statistics.median(xs) * 1000:5.0f} ms "
                  f"(min {min(xs) * 1000:.0f}, max {max(xs) * 1000:.0f}, n={len(xs)}) (target < 100 ms)")
        return 0
    finally:
        bare.stop()
        buf.stop()
        if args.keep:
            print(f"kept {tmp}", flush=True)
        else:   # ~200 MB of segments a run: left in the page cache as dirty pages, they slow the next run's writes
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
