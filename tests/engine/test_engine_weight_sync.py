"""Weight sync into a real reference-engine process over real torch.distributed (gloo) on loopback.

The trainer side is ``shared.weight_sync.WeightSender`` in this test process (rank 0); the engine
joins through ``/init_weights_update_group`` and receives flat buckets inside a begin/end session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.engine.engine_contract import generate, hf_logprobs, post, prompt_ids
from tests.procs import reference_engine


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from headrace.shared.modelzoo import init_model

    root = tmp_path_factory.mktemp("models")
    return init_model("tiny-qwen2", root / "a", seed=0), init_model("tiny-qwen2", root / "b", seed=1)


@pytest.fixture(scope="module")
def engine_url(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with reference_engine(models[0], tmp_path_factory.mktemp("logs") / "engine.log",
                          "--weight-sync-timeout", "60") as (url, _):
        yield url


class _E:
    def __init__(self, url: str) -> None:
        self.url = url


def greedy(url: str, k: int = 0) -> list[int]:
    sp = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    return generate(_E(url), input_ids=prompt_ids(k), sampling_params=sp)["output_ids"]


def state_dict(model_dir: Path) -> list[tuple[str, "object"]]:
    from headrace.rollout.engine.model import iter_safetensors

    return list(iter_safetensors(model_dir))


def test_weights_broadcast_from_a_trainer_rank_replace_the_model(engine_url: str, models: tuple[Path, Path]) -> None:
    from headrace.shared.weight_sync import EngineTarget, WeightSender

    a, b = models
    before = greedy(engine_url, 1)
    sender = WeightSender([EngineTarget(engine_url)], backend="gloo", bucket_bytes=1 << 20, timeout_s=60)
    try:
        sender.connect()
        sender.update(state_dict(b), weight_version=3)
        assert sender.last_stats["buckets"] > 1                        # several flat buckets
        info = httpx.get(f"{engine_url}/get_model_info", timeout=30).json()
        assert info["weight_version"] == "3"
        res = generate(_E(engine_url), input_ids=prompt_ids(1), return_logprob=True,
                       sampling_params={"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True})
        assert res["meta_info"]["weight_version"] == "3"
        ref = hf_logprobs(str(b), prompt_ids(1), res["output_ids"])  # teacher-forced on model b
        for i, (lp, tid, _) in enumerate(res["meta_info"]["output_token_logprobs"]):
            assert abs(lp - float(ref[i, tid])) < 1e-3
        sender.update(state_dict(a), weight_version=4)
        assert greedy(engine_url, 1) == before
    finally:
        sender.shutdown()


def test_a_failed_update_is_refused_until_a_whole_update_succeeds(engine_url: str, models: tuple[Path, Path]) -> None:
    import torch

    from headrace.shared.weight_sync import EngineTarget, WeightSender, WeightSyncError

    a, _ = models
    before = greedy(engine_url, 2)
    bad = [("model.norm.weight", torch.ones(7))]                   # wrong shape: the engine must refuse it
    sender = WeightSender([EngineTarget(engine_url)], backend="gloo", timeout_s=60)
    try:
        sender.connect()
        with pytest.raises(WeightSyncError):
            sender.update(bad, weight_version=9)
        r = post(_E(engine_url), "/generate", {"input_ids": prompt_ids(2)})
        assert r.status_code == 503 and "failed update" in r.json()["error"]["message"]
        assert httpx.get(f"{engine_url}/get_model_info", timeout=30).json()["weight_version"] != "9"
        sender.reconnect()
        sender.update(state_dict(a), weight_version=10)
        assert greedy(engine_url, 2) == before
    finally:
        sender.shutdown()
