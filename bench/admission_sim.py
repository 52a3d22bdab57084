"""Continuous rollout's admission rule with k services on one buffer, simulated (no processes).

Each service admits a group while ``shared.staleness.admits`` (or a rule below) lets it; an
admitted group lands in the buffer ``--latency`` training steps later (engines batch, so groups in
flight do not slow each other here); the trainer leases ``--gps`` groups as soon as the buffer has
them and trains for one step. Printed per rule and k: trainer steps done in ``--horizon`` steps'
time, the time it waited for groups, and the most groups ever ahead of it (buffer + in flight;
the cap is ``(max_staleness + 1) x gps``). Rules:

- ``whole``: each service against the whole cap (what one service alone does; before 4 Dec every
  service of several did this): up to k x cap ahead;
- ``shares`` (``admits``): its share of the cap and of the backlog;
- ``strict``: ``backlog + in_flight_i < share_i``, the bound that holds without knowing the
  others' in-flight groups, which stops generation while the buffer holds a step.

    python bench/admission_sim.py [--gps 8] [--max-staleness 1] [--latency 0.3,0.8,1.5,3]

Measured 4 Dec (defaults): ``shares`` does as many steps as one service in every case and never
exceeds the cap (the services push at the same pace); ``strict`` loses 20% of the steps at
latency 1.5 and 25% at 3; ``whole`` holds 2x / 4x the cap ahead with k = 2 / 4 (at latency 3 it
does more steps, from groups generated up to 4 versions ahead, which the buffer would evict as
stale with max_staleness 1: staleness is not simulated).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headrace.shared.staleness import admission_cap, admission_share, admits  # noqa: E402


def simulate(rule: str, k: int, gps: int, max_staleness: int, latency: float, horizon: float,
             dt: float = 0.01) -> tuple[int, float, int]:
    """(trainer steps, seconds waited for groups, most groups ahead of the trainer)."""
    cap = admission_cap(max_staleness, gps)
    shares = [admission_share(cap, i, k) for i in range(k)]
    in_flight, backlog, landing = [0] * k, 0, []
    steps, waited, most, t, busy_until = 0, 0.0, 0, 0.0, 0.0
    while t < horizon:
        while landing and landing[0][0] <= t:
            _, i = heapq.heappop(landing)
            in_flight[i] -= 1
            backlog += 1
        if t >= busy_until:
            if backlog >= gps:
                backlog, steps, busy_until = backlog - gps, steps + 1, t + 1.0
            else:
                waited += dt
        for i in range(k):
            while {"whole": backlog + in_flight[i] < cap,
                   "shares": admits(backlog, in_flight[i], cap, i, k),
                   "strict": backlog + in_flight[i] < shares[i]}[rule]:
                in_flight[i] += 1
                heapq.heappush(landing, (t + latency, i))
        most = max(most, backlog + sum(in_flight))
        t += dt
    return steps, round(waited, 1), most


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gps", type=int, default=8, help="groups per step")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--latency", default="0.3,0.8,1.5,3", help="group latency in training steps, comma-separated")
    ap.add_argument("--horizon", type=float, default=200.0, help="simulated time, in training steps")
    args = ap.parse_args()
    cap = admission_cap(args.max_staleness, args.gps)
    print(f"cap {cap} groups ahead; columns: steps done, time waited, most groups ahead")
    for latency in (float(x) for x in args.latency.split(",")):
        one = simulate("whole", 1, args.gps, args.max_staleness, latency, args.horizon)
        row = [f"latency {latency:g}: one service {one}"]
        for k in (2, 4):
            for rule in ("whole", "shares", "strict"):
                row.append(f"k={k} {rule} {simulate(rule, k, args.gps, args.max_staleness, latency, args.horizon)}")
        print(" | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
