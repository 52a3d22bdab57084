"""``headrace train`` with ``trainer.lora`` against a real ``headrace buffer serve``: a train-only
run learns the synthetic task with adapters only, every lease is acked, the checkpoint names the
base, and the final export writes the merged ``hf`` beside the PEFT ``hf-lora`` (what ``headrace
run`` does at the end). ~40 s on the 2-core machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headrace.shared.client import BufferClient
from tests.procs import Proc, free_port, headrace_cmd
from tests.trainer.support import GROUPS_PER_STEP, metrics, run_train, synthetic_groups, write_config

STEPS = 16


@pytest.fixture
def buffer(tmp_path: Path):
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
def test_lora_train_only_run_learns_and_exports_both(tmp_path: Path, buffer: str) -> None:
    from safetensors.torch import load_file

    from headrace.shared.modelzoo import init_model

    model_dir = init_model("micro-qwen2", tmp_path / "micro-qwen2", seed=1)
    with BufferClient(buffer) as c:
        assert c.post_groups(synthetic_groups(STEPS * GROUPS_PER_STEP)).accepted == STEPS * GROUPS_PER_STEP
    cfg = write_config(tmp_path, model_dir, buffer, steps=STEPS, lr=2e-2, export_hf=True, kl_coef=0.01,
                       lora={"rank": 8, "alpha": 64})
    rc, log = run_train(tmp_path, cfg, buffer)
    assert rc == 0, log
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    nll = [-r["logprob_pos_adv"] for r in rows]       # NLL of the rewarded responses, before each update
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 0.15, nll     # measured: 6.23 -> 6.01 (deterministic on CPU)
    gap = [r["logprob_pos_adv"] - r["logprob_mean"] for r in rows]
    assert gap[-1] > gap[0] + 0.05, gap                         # rewarded answers now preferred over the rest
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6), "step 1 starts at the base (B = 0)"
    assert rows[-1]["kl_ref"] > 0
    with BufferClient(buffer) as c:
        s = c.stats()
    assert (s.consumed, s.leased, s.queued) == (STEPS * GROUPS_PER_STEP, 0, 0)
    latest = tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text()
    assert json.loads((latest / "meta.json").read_text())["lora"]["base_model"] == str(model_dir)
    out = tmp_path / "out"
    conf = json.loads((out / "hf-lora" / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (8, 64, "LORA")
    base, merged = load_file(str(model_dir / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
    changed = {n for n in base if not base[n].equal(merged[n])}
    assert changed and all(n.endswith("_proj.weight") for n in changed), sorted(changed)[:5]
