"""The demo against a plain loop: ``headrace run`` of the built-in demo recipe vs one plain process
doing the same GRPO (bench/demo_feasibility.py), in one run on one machine, one after the other.

Both start from the demo's own warm-started model (``deploy.demo.prepare_demo_model``, cached in
``models/``) with the demo's task, prompts, reward, 64 prompts x 8 samples, lr 1e-4, for ``--steps``
steps. Evaluation is left out of the timed part on both sides: the plain loop evaluates at step 0
and at its end only (outside its GRPO time), ``headrace run`` runs with ``run.eval_every: 0``.

Prints, for each side, the wall time of the whole command (``headrace run`` includes starting its
buffer, rollout service, engine and trainer; the plain loop includes loading the model) and the
seconds per training step (the plain loop's GRPO time / steps; Headrace: the median of
metrics.jsonl's ``iteration_s``), then the ratios Headrace / plain (target: wall <= 1.1x) and
Headrace's phase medians per step (generate, train step, weight sync, memory release / resume,
lease wait), so a miss says where the time went.

    python bench/demo_vs_plain.py [--steps 50] [--out runs/bench/demo_vs_plain]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("generate_s", "step_time_s", "weight_sync_s", "release_memory_s", "resume_memory_s", "resume_s",
          "lease_wait_s")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_plain(model: Path, steps: int, out: Path, threads: int) -> dict:
    """bench/demo_feasibility.py on ``model``: wall of the process, GRPO seconds per step."""
    curve = out / "plain.json"
    t0 = time.perf_counter()
    with open(out / "plain.log", "w") as log:
        subprocess.run([sys.executable, str(REPO / "bench" / "demo_feasibility.py"), "--model", str(model),
                        "--steps", str(steps), "--eval-every", str(steps + 1), "--groups", "64", "--group-size", "8",
                        "--lr", "1e-4", "--threads", str(threads), "--json", str(curve)],
                       check=True, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    wall = time.perf_counter() - t0
    last = json.loads(curve.read_text())["curve"][-1]
    return {"wall_s": wall, "step_s": last["grpo_s"] / steps}


def run_headrace(model: Path, steps: int, out: Path) -> dict:
    """``headrace run`` of the demo recipe on ``model`` without evaluation: wall and phase medians."""
    import yaml

    from headrace.deploy.demo import demo_config_dict

    run_dir = out / "headrace"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cfg = demo_config_dict(model=str(model), out=str(run_dir), steps=steps, eval_every=0)
    cfg_path = out / "demo.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    with open(out / "headrace.log", "w") as log:
        subprocess.run([sys.executable, "-m", "headrace.deploy.cli", "run", "--config", str(cfg_path)],
                       check=True, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r.get("loss") is not None]
    med = {k: statistics.median(r[k] for r in steps_rows if k in r) for k in PHASES + ("iteration_s",)
           if any(k in r for r in steps_rows)}
    return {"wall_s": wall, "step_s": med.get("iteration_s", float("nan")), "phases": med,
            "steps": len(steps_rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "demo_vs_plain")
    ap.add_argument("--plain-threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the plain loop (default: every core; it is one process)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from headrace.deploy.demo import prepare_demo_model

    model = prepare_demo_model(REPO / "models", log=lambda s: print(s, flush=True))
    print(f"model {model}, {args.steps} steps of 64 x 8; each side alone, one after the other", flush=True)
    plain = run_plain(model, args.steps, args.out, args.plain_threads)
    print(f"plain loop:    wall {plain['wall_s']:7.1f} s, {plain['step_s']:.3f} s per step "
          f"({args.plain_threads} torch threads)", flush=True)
    ours = run_headrace(model, args.steps, args.out)
    print(f"headrace run:  wall {ours['wall_s']:7.1f} s, {ours['step_s']:.3f} s per step (median iteration_s, "
          f"{ours['steps']} steps)", flush=True)
    print("headrace phases (median s per step): " + ", ".join(f"{k.removesuffix('_s')} {v:.3f}"
                                                               for k, v in ours["phases"].items()))
    ratio = ours["wall_s"] / plain["wall_s"]
    print(f"ratio wall {ratio:.3f} (target <= 1.1), per step {ours['step_s'] / plain['step_s']:.3f}")
    print(json.dumps({"bench": "demo_vs_plain", "steps": args.steps, "plain_threads": args.plain_threads, "plain": plain, "headrace": ours,
                      "wall_ratio": ratio, "step_ratio": ours["step_s"] / plain["step_s"],
                      "meets_target": ratio <= 1.1}))


if __name__ == "__main__":
    main()
