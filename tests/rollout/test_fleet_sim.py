"""bench/fleet_sim.py in a tiny configuration: real processes (simulated engines, buffers, a rollout
service, producers) on loopback; checks that it runs and prints DESIGN.md's lines, parseable, with
GPUs = groups/s x n x new_tokens / per-GPU tokens/s. No figure is asserted (no timing assertions).
Costs ~20-40 s on the 2-core machine (one rollout service start dominates)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.procs import REPO, child_env

ROLLOUT = re.compile(r"^rollout service: ([0-9.]+) groups/s with ([0-9]+) engines = ([0-9]+) GPUs$")
BUFFER = re.compile(r"^buffer: ([0-9.]+) groups/s from ([0-9]+) producers = ([0-9]+) GPUs$")


@pytest.mark.slow
def test_fleet_sim_runs_and_prints_the_design_lines() -> None:
    n, new_tokens, per_gpu = 2, 16, 100.0
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fleet_sim.py"), "--engines", "2", "--groups", "4", "--rounds", "1",
         "--n", str(n), "--new-tokens", str(new_tokens), "--producers", "2", "--push-batch", "2",
         "--buffer-seconds", "1", "--gpu-tokens-per-s", str(per_gpu)],
        capture_output=True, text=True, timeout=300, env=child_env(), cwd=str(REPO))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if not ln.startswith("#")]
    rollout = [m for m in map(ROLLOUT.match, lines) if m]
    buffer = [m for m in map(BUFFER.match, lines) if m]
    assert [int(m.group(2)) for m in rollout] == [2], out.stdout
    assert [int(m.group(2)) for m in buffer] == [2], out.stdout
    assert len(lines) == 2, out.stdout                     # nothing else but the detail lines
    for m in rollout + buffer:
        rate, g = float(m.group(1)), int(m.group(3))
        assert rate > 0
        assert g == round(rate * n * new_tokens / per_gpu) or abs(g - rate * n * new_tokens / per_gpu) <= 1


SERVICES = re.compile(r"^2 rollout services: ([0-9.]+) groups/s with 3 engines = ([0-9]+) GPUs$")


@pytest.mark.slow
def test_fleet_sim_drives_several_rollout_services_together() -> None:
    """``--services 2``: two real rollout services (engine blocks of 2 and 1, prompt shards 0 and 1)
    answer every round together; more services than engines is refused before anything starts."""
    base = [sys.executable, str(REPO / "bench" / "fleet_sim.py"), "--groups", "6", "--rounds", "1", "--n", "2",
            "--new-tokens", "16", "--producers", "0", "--gpu-tokens-per-s", "100"]
    out = subprocess.run(base + ["--engines", "3", "--services", "2"], capture_output=True, text=True, timeout=300,
                         env=child_env(), cwd=str(REPO))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if not ln.startswith("#")]
    assert len(lines) == 1 and SERVICES.match(lines[0]), out.stdout
    assert float(SERVICES.match(lines[0]).group(1)) > 0
    detail = [ln for ln in out.stdout.splitlines() if ln.startswith("# ")]
    assert '"services": 2' in detail[0], detail
    bad = subprocess.run(base + ["--engines", "2", "--services", "3"], capture_output=True, text=True, timeout=120,
                         env=child_env(), cwd=str(REPO))
    assert bad.returncode != 0 and "--services 3: needs 1 <= services <= every engine count ([2])" in bad.stderr
