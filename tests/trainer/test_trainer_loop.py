"""The ``headrace train`` loop against a real ``headrace buffer serve`` process over HTTP.

- a 20-step train-only run on a fixed buffer of synthetic groups learns: the policy's log-probability
  of the rewarded responses rises (their NLL, the quantity GRPO lowers, falls), every lease is acked,
  the policy version reaches 20, metrics are one JSON line per step and a checkpoint is written;
- bad input (token outside the vocabulary, prompts that differ within a group, a batch with no
  trainable token) is rejected: the bad groups are dead-lettered with the reason naming them, the
  lease's other groups are back in the queue, nothing is consumed;
- beyond ``trainer.max_rejected_fraction`` the trainer stops with the error and keeps its state
  (step, version, checkpoint of the steps before, those steps acked).

The poison group, trainer kill -9 and buffer restart runs are in test_exactly_once.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headrace.shared.client import BufferClient
from headrace.shared.config import load_config
from tests.procs import Proc, child_env, free_port, headrace_cmd
from tests.trainer.support import GROUPS_PER_STEP, bad_group, metrics, run_train, synthetic_groups, write_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model("micro-qwen2", tmp_path_factory.mktemp("model") / "micro-qwen2", seed=1)


@pytest.fixture
def buffer(tmp_path):
    port = free_port()
    proc = Proc(headrace_cmd("buffer", "serve", "--memory", "--port", str(port), "--max-staleness", "1000"),
                tmp_path / "buffer.log")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=60)
        yield url
    finally:
        proc.stop()


@pytest.mark.slow
def test_twenty_steps_train_only_learns_and_acks(tmp_path, model_dir, buffer):
    with BufferClient(buffer) as c:
        assert c.post_groups(synthetic_groups(20 * GROUPS_PER_STEP)).accepted == 80
    rc, log = run_train(tmp_path, write_config(tmp_path, model_dir, buffer), buffer)
    assert rc == 0, log
    assert "train-only" in log and "done at step 20" in log
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert [r["policy_version"] for r in rows] == list(range(1, 21))
    nll = [-r["logprob_pos_adv"] for r in rows]      # NLL of the rewarded responses, before each update
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 1.0, nll
    gap = [r["logprob_pos_adv"] - r["logprob_mean"] for r in rows]
    assert gap[-1] > gap[0]                          # rewarded answers now preferred over the rest
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm", "reward_mean",
                "reward_std", "response_length", "rollout_logprob_abs_diff", "tokens_per_s"):
        assert key in rows[-1], key
    assert "kl" not in rows[-1] and "kl_ref" not in rows[-1]   # approx_kl only: no reference model (kl_coef 0)
    assert rows[0]["reward_mean"] == pytest.approx(0.5)
    with BufferClient(buffer) as c:
        s = c.stats()
    assert (s.consumed, s.leased, s.queued, s.policy_version) == (80, 0, 0, 20)
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000020"


@pytest.mark.parametrize("kind,match", [("vocab", "outside the vocabulary"), ("prompt", "prompt tokens differ"),
                                        ("empty", "no trainable token")])
def test_lease_source_rejects_bad_groups(tmp_path, buffer, kind, match):
    """Rank 0's lease path alone (no model needed): real HTTP, real buffer."""
    from headrace.trainer.lease import LeaseSource

    groups = synthetic_groups(GROUPS_PER_STEP - 1) if kind != "empty" else []
    groups.append(bad_group(kind, "the-bad-one"))
    groups += [bad_group("empty", f"masked-{k}") for k in range(GROUPS_PER_STEP - len(groups))]
    bad = ["the-bad-one"] if kind != "empty" else [g.group_id for g in groups]
    with BufferClient(buffer) as c:
        c.post_groups(groups)
        cfg = load_config(write_config(tmp_path, tmp_path, buffer))
        src = LeaseSource(cfg, buffer, None, 0, vocab_size=512, max_seq_len=2048)
        assert src.next() is None             # the rest is back in the queue, one step short: train-only stops
        dead = c.dead_letters()
        assert sorted(d["group_id"] for d in dead) == sorted(bad)
        assert all(match in d["reason"] for d in dead), dead
        s = c.stats()
        assert (s.queued, s.leased, s.consumed, s.dead_lettered) == (GROUPS_PER_STEP - len(bad), 0, 0, len(bad))
        assert (src.groups_leased, src.groups_rejected) == (GROUPS_PER_STEP, len(bad))
        src.close()


@pytest.mark.slow
def test_too_many_rejected_groups_stop_the_trainer_with_state_kept(tmp_path, model_dir, buffer):
    with BufferClient(buffer) as c:
        c.post_groups(synthetic_groups(GROUPS_PER_STEP))
        c.post_groups(synthetic_groups(GROUPS_PER_STEP - 1, start=100) + [bad_group("vocab", "poisoned")])
    # two DP ranks: the error travels from rank 0 to rank 1 by broadcast; no rejection tolerated
    rc, log = run_train(tmp_path, write_config(tmp_path, model_dir, buffer, save_every=0, dp=2,
                                               max_rejected_fraction=0.0), buffer)
    assert rc == 1, log
    assert "tp=1 dp=2" in log
    assert "poisoned" in log and "outside the vocabulary" in log and "max_rejected_fraction" in log
    assert [r["step"] for r in metrics(tmp_path)] == [1]
    with BufferClient(buffer) as c:
        s = c.stats()
        dead = c.dead_letters()
    assert (s.consumed, s.queued, s.leased, s.dead_lettered, s.policy_version) == \
        (GROUPS_PER_STEP, GROUPS_PER_STEP - 1, 0, 1, 1)             # step 1 acked after its checkpoint
    assert [d["group_id"] for d in dead] == ["poisoned"] and "outside the vocabulary" in dead[0]["reason"]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "step_00000001"   # the state before the bad lease, saved
    assert {p.name for p in (ckpt / "step_00000001").iterdir()} >= {"model_tp0.pt", "rng_rank0.pt", "rng_rank1.pt"}
    meta = json.loads((ckpt / "step_00000001" / "meta.json").read_text())
    assert (meta["step"], meta["policy_version"], meta["groups_consumed"]) == (1, 1, GROUPS_PER_STEP)


def _sigterm_when(proc: Proc, tmp_path: Path, rows: int, limit: float = 300.0) -> None:
    import os
    import signal
    import time

    deadline = time.monotonic() + limit
    path = tmp_path / "out" / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.alive(), proc.log()
        if path.is_file() and len(path.read_text().splitlines()) >= rows:
            os.kill(proc.pid, signal.SIGTERM)      # the launcher only: it passes the signal to its ranks
            return
        time.sleep(0.2)
    pytest.fail(f"fewer than {rows} steps within {limit}s:\n{proc.log()}")


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_it_and_resume_continues(tmp_path, model_dir, buffer):
    steps = 30
    with BufferClient(buffer) as c:
        c.post_groups(synthetic_groups(steps * GROUPS_PER_STEP))
    # two DP ranks (gloo) must agree on the stop; a lease wait far longer than the test allows shows
    # that a rank 0 waiting for groups notices the request too
    config = write_config(tmp_path, model_dir, buffer, dp=2, save_every=0, lease_wait_s=600.0, export_hf=True)
    cmd = headrace_cmd("train", "--config", str(config), "--buffer-url", buffer)

    proc = Proc(cmd, tmp_path / "train1.log", env=child_env(threads=1))
    try:
        _sigterm_when(proc, tmp_path, rows=2)        # mid-run: steps keep coming
        assert proc.popen.wait(120) == 0, proc.log()
    finally:
        proc.stop()
    log = (tmp_path / "train1.log").read_text()
    assert "stopped on request (SIGTERM) at step" in log, log
    done = [r["step"] for r in metrics(tmp_path)]
    k = done[-1]
    assert done == list(range(1, k + 1)) and k < steps
    assert (tmp_path / "ckpt" / "latest").read_text() == f"step_{k:08d}"   # save_every 0: only the stop saved it
    assert not (tmp_path / "out" / "hf").exists()                          # not finished: no export
    with BufferClient(buffer) as c:
        s = c.stats()
    assert (s.consumed, s.leased, s.policy_version) == (k * GROUPS_PER_STEP, 0, k)   # the last step was acked

    proc = Proc(cmd, tmp_path / "train2.log", env=child_env(threads=1))
    try:
        _sigterm_when(proc, tmp_path, rows=steps)   # every group consumed: rank 0 now waits for more
        assert proc.popen.wait(60) == 0, proc.log()   # far less than lease_wait_s
    finally:
        proc.stop()
    log = (tmp_path / "train2.log").read_text()
    assert "resumed from" in log and "stopped on request (SIGTERM) at step 30" in log, log
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, steps + 1))
    assert (tmp_path / "ckpt" / "latest").read_text() == f"step_{steps:08d}"
    with BufferClient(buffer) as c:
        s = c.stats()
    assert (s.consumed, s.leased, s.queued, s.policy_version) == (steps * GROUPS_PER_STEP, 0, 0, steps)
