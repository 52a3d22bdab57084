"""Exactly-once consumption through faults (DESIGN.md "Exactly-once consumption"), with real
processes: ``headrace buffer serve`` and ``headrace train`` (train-only) over loopback HTTP.

- a poison group in the queue (a token id beyond the model's vocabulary) is dead-lettered with its
  reason (``GET /v1/dead_letters``) and training goes on to the configured steps;
- kill -9 of the trainer between checkpoints, then a resume: the held leases of the steps after
  the last checkpoint were never acked, so their groups come back and are trained again;
- kill -9 of the buffer mid-run and a restart on the same database: the trainer retries, its
  leases are still valid, training completes.

Each ends with the invariant any fault test checks: consumed groups == final step x
groups_per_step (the buffer counts each group id once, and the final checkpoint's own count
agrees), nothing queued or leased, nothing dead-lettered but the poison.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from headrace.shared.client import BufferClient
from tests.buffer.support import start_buffer
from tests.procs import Proc, child_env, free_port, headrace_cmd
from tests.trainer.support import GROUPS_PER_STEP, bad_group, metrics, run_train, synthetic_groups, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model("micro-qwen2", tmp_path_factory.mktemp("model") / "micro-qwen2", seed=1)


def _trainer(tmp_path: Path, config: Path, url: str, name: str) -> Proc:
    return Proc(headrace_cmd("train", "--config", str(config), "--buffer-url", url), tmp_path / f"{name}.log",
                env=child_env(threads=1))


def _wait_rows(proc: Proc, tmp_path: Path, rows: int, limit: float = 300.0) -> None:
    path = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.alive(), proc.log()
        if path.is_file() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.1)
    pytest.fail(f"fewer than {rows} steps within {limit}s:\n{proc.log()}")


def _queue_steps(url: str, first: int, last: int) -> None:
    """Queue the synthetic groups of steps ``first``+1 .. ``last`` (ids continue across calls)."""
    with BufferClient(url) as c:
        c.post_groups(synthetic_groups((last - first) * GROUPS_PER_STEP, start=first * GROUPS_PER_STEP))


def _final_meta(tmp_path: Path) -> dict:
    ckpt = tmp_path / "ckpt"
    return json.loads((ckpt / (ckpt / "latest").read_text() / "meta.json").read_text())


def _assert_invariant(url: str, tmp_path: Path, steps: int, dead: list[str]) -> None:
    with BufferClient(url) as c:
        s = c.stats()
        letters = c.dead_letters()
    assert (s.consumed, s.queued, s.leased, s.held) == (steps * GROUPS_PER_STEP, 0, 0, 0), s
    assert sorted(d["group_id"] for d in letters) == sorted(dead)
    meta = _final_meta(tmp_path)
    assert (meta["step"], meta["groups_consumed"]) == (steps, steps * GROUPS_PER_STEP)


def test_a_poison_group_is_dead_lettered_and_training_goes_on(tmp_path, model_dir):
    proc, url = start_buffer(tmp_path, "--memory", "--max-staleness", "1000")
    try:
        steps = 3
        good = synthetic_groups(steps * GROUPS_PER_STEP)
        with BufferClient(url) as c:   # the poison sits in the second step's lease
            c.post_groups(good[:6] + [bad_group("vocab", "poison")] + good[6:])
        rc, log = run_train(tmp_path, write_config(tmp_path, model_dir, url, steps=steps), url)
        assert rc == 0, log
        assert f"done at step {steps}" in log and "rejected 1 group(s)" in log and "outside the vocabulary" in log
        assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
        _assert_invariant(url, tmp_path, steps, dead=["poison"])
        with BufferClient(url) as c:
            (letter,) = c.dead_letters()
        assert "token id 515 is outside the vocabulary" in letter["reason"] and letter["at"]
        print(f"\npoison: produced {len(good) + 1}, consumed {steps * GROUPS_PER_STEP}, dead-lettered 1, lost 0")
    finally:
        proc.stop()


def test_kill9_of_the_trainer_between_checkpoints_replays_the_uncheckpointed_groups(tmp_path, model_dir):
    proc, url = start_buffer(tmp_path, "--db", str(tmp_path / "buffer.sqlite"), "--max-staleness", "1000")
    try:
        steps, every, before = 12, 5, 7
        # only 7 steps' worth is queued at first, so the first trainer cannot pass step 7 (checkpoint 5),
        # however late a loaded machine lets the kill come (a CI run once saw it reach checkpoint 10)
        _queue_steps(url, 0, before)
        # held leases live lease_s after the kill; the resumed trainer waits longer than that for them
        config = write_config(tmp_path, model_dir, url, lease_s=6, steps=steps, save_every=every, lease_wait_s=30)
        first = _trainer(tmp_path, config, url, "train1")
        try:
            _wait_rows(first, tmp_path, before)
            first.kill9()
        finally:
            first.stop()
        trained = len(metrics(tmp_path))
        saved = _final_meta(tmp_path)["step"]
        assert (saved, trained) == (every, before)
        _queue_steps(url, before, steps)
        with BufferClient(url) as c:
            s = c.stats()
        assert s.consumed == saved * GROUPS_PER_STEP          # acked only what a checkpoint contains
        assert s.leased >= (trained - saved) * GROUPS_PER_STEP  # held (and maybe the next step's lease)

        rc, log = run_train(tmp_path, config, url)
        assert rc == 0, log
        assert "resumed from" in log and f"done at step {steps}" in log
        rows = [r["step"] for r in metrics(tmp_path)]
        assert rows == list(range(1, trained + 1)) + list(range(saved + 1, steps + 1))   # saved+1..trained twice
        _assert_invariant(url, tmp_path, steps, dead=[])
        replayed = (trained - saved) * GROUPS_PER_STEP
        print(f"\ntrainer kill -9 at step {trained} (checkpoint {saved}): produced {steps * GROUPS_PER_STEP}, "
              f"consumed {steps * GROUPS_PER_STEP}, replayed {replayed}, dead-lettered 0, lost 0")
    finally:
        proc.stop()


def test_kill9_and_restart_of_the_buffer_mid_run(tmp_path, model_dir):
    db, port = tmp_path / "buffer.sqlite", free_port()
    proc, url = start_buffer(tmp_path, "--db", str(db), "--max-staleness", "1000", port=port)
    steps, before = 10, 6
    try:
        _queue_steps(url, 0, before)   # 6 steps' worth first: the kill comes mid-run however late it comes
        # a lease whose answer the kill lost holds its groups lease_s: the trainer waits longer
        config = write_config(tmp_path, model_dir, url, lease_s=20, steps=steps, save_every=3, lease_wait_s=45)
        trainer = _trainer(tmp_path, config, url, "train")
        try:
            _wait_rows(trainer, tmp_path, 4)
            proc.kill9()
            proc.stop()
            time.sleep(2.0)                                   # the trainer meets a dead buffer
            proc, url = start_buffer(tmp_path, "--db", str(db), "--max-staleness", "1000", port=port,
                                     name="buffer2")
            _queue_steps(url, before, steps)
            assert trainer.popen.wait(400) == 0, trainer.log()
        finally:
            trainer.stop()
        log = (tmp_path / "train.log").read_text()
        assert "buffer" in log and "retry" in log and f"done at step {steps}" in log
        assert [r["step"] for r in metrics(tmp_path)] == list(range(1, steps + 1))
        _assert_invariant(url, tmp_path, steps, dead=[])
        print(f"\nbuffer kill -9 + restart: produced {steps * GROUPS_PER_STEP}, consumed {steps * GROUPS_PER_STEP}, "
              f"replayed 0, dead-lettered 0, lost 0")
    finally:
        proc.stop()
