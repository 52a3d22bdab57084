"""End to end: a TP=2 trainer (two real processes, gloo) pushes its model through WeightSender into
two real reference engines (``headrace engine serve``); the engines' greedy logprobs then equal
what the trainer's model computes. Engines that die (SIGKILL) or hang (SIGSTOP) mid-update give a
WeightSyncError naming their URL, and the survivors never report the new version."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.procs import Proc, child_env, free_port, headrace_cmd

PROMPT = [5, 9, 14, 3, 22, 7, 11, 4]
NEW_TOKENS = 8


def start_engine(model_dir: Path, log: Path) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(headrace_cmd("engine", "serve", "--model", str(model_dir), "--port", str(port), "--threads", "1",
                             "--weight-sync-timeout", "60"), log, env=child_env(threads=1))
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/health", timeout=120)
    return proc, url


def greedy(url: str) -> dict:
    r = httpx.post(f"{url}/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def model_version(url: str) -> str:
    return httpx.get(f"{url}/get_model_info", timeout=30).json()["weight_version"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from headrace.shared.modelzoo import init_model

    root = tmp_path_factory.mktemp("models")
    return init_model("tiny-qwen2", root / "a", seed=0), init_model("tiny-qwen2", root / "b", seed=1)


@pytest.fixture(scope="module")
def engines(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("engines")
    started = []
    try:
        for i in range(2):
            started.append(start_engine(models[0], logs / f"engine{i}.log"))
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            proc.stop()


def _trainer_push(model_dir: str, urls: list[str], version: int, load_format: str | None = "auto") -> dict | None:
    """One TP rank of the trainer: load, perturb (so the pushed weights are on no disk), push
    from rank 0 while rank 1 takes part in the TP gathers, then score the engines' outputs. With
    one rank it pushes views of its live parameters (``hf_state_dict(copy=False)``, as
    ``EngineControl`` does) and also returns the order and shapes it sends."""
    import torch
    import torch.distributed as dist

    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from headrace.trainer.model import load_model
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(int(os.environ["WORLD_SIZE"]), 1)         # every rank in the TP group
    try:
        model = load_model(model_dir, info)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0 + version / 60)     # each test's push differs from the last one's
        outs, stats, order = None, None, None
        if info.rank == 0:
            sender = WeightSender([EngineTarget(u) for u in urls], bucket_bytes=64 << 10, timeout_s=120,
                                  load_format=load_format)
            sender.connect()
            try:
                order = [(n, list(t.shape)) for n, t in model.hf_state_dict()] if info.tp == 1 else None
                sender.update(model.hf_state_dict(copy=info.tp > 1), weight_version=version)
                stats = dict(sender.last_stats)
                outs = [greedy(u) for u in urls]
            finally:
                sender.shutdown()
        else:
            for _ in model.hf_state_dict():  # the TP gathers are collectives
                pass
        box = [outs]
        dist.broadcast_object_list(box, src=0)
        trainer_lps = []
        with torch.no_grad():
            for out in box[0]:
                ids = PROMPT + out["output_ids"]
                lp, _ = model.token_logprobs(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0, len(ids)]),
                                             torch.tensor(ids[1:] + [0]))
                trainer_lps.append(lp[len(PROMPT) - 1:len(ids) - 1].tolist())
        return {"outs": box[0], "trainer": trainer_lps, "stats": stats, "order": order} if info.rank == 0 else None
    finally:
        destroy_distributed()


@pytest.mark.slow
@pytest.mark.parametrize("tp,load_format", [(2, "auto"), (1, "auto")])
def test_trainer_update_makes_engines_compute_the_trainer_model(engines: list[str], models: tuple[Path, Path],
                                                                tp: int, load_format: str) -> None:
    """TP 2 with gloo's default (one broadcast per tensor), and TP 1 pushing views of the live
    parameters: they lie back to back (``lay_out_flat``), so with the default load format every
    bucket goes flat straight from the parameters, no pack copy, and the reference engine receives
    it straight into its weights: its layout is the trainer's order, so every bucket is one
    contiguous range of them (checked here on the order the trainer sent)."""
    import torch

    from headrace.rollout.engine.model import DecoderModel
    from headrace.rollout.engine.receiver import WeightReceiver
    from headrace.shared.weight_sync import plan_buckets
    from headrace.trainer.launch import spawn

    before = [[lp for lp, _, _ in greedy(u)["meta_info"]["output_token_logprobs"]] for u in engines]
    result = spawn(_trainer_push, tp, str(models[1]), engines, 5 + tp, load_format, timeout_s=300)[0]
    if tp == 1:
        engine_model = DecoderModel.from_pretrained(models[1])
        named = [(n, torch.empty(shape)) for n, shape in result["order"]]
        buckets = list(plan_buckets(named, 64 << 10))
        assert len(buckets) > 3
        for b in buckets:
            got = WeightReceiver()._own_range([n for n, _ in b], torch.float32, [list(t.shape) for _, t in b],
                                              engine_model.param_view)
            assert got is not None, [n for n, _ in b]
            assert got[0].numel() == sum(t.numel() for _, t in b)
        assert result["stats"]["zero_copy_buckets"] == result["stats"]["buckets"]
    assert result["stats"]["buckets"] > 1
    for url, out, trainer_lp in zip(engines, result["outs"], result["trainer"]):
        assert out["meta_info"]["weight_version"] == str(5 + tp) and model_version(url) == str(5 + tp)
        engine_lp = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        assert len(engine_lp) == NEW_TOKENS
        assert engine_lp == pytest.approx(trainer_lp, abs=1e-3)
        # greedy: each token is the argmax, so the engine never picked a token the trainer finds unlikely
        assert max(trainer_lp) <= 0
    assert result["outs"][0]["output_ids"] == result["outs"][1]["output_ids"]
    after = [lp for lp, _, _ in result["outs"][0]["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(before[0], after)) > 1e-3  # the update really changed the model


def _iter_then(tensors: list, at: int, action) -> Iterator:
    for i, item in enumerate(tensors):
        if i == at:
            action()
        yield item


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_engine_fault_mid_update_is_named(fault: str, models: tuple[Path, Path], tmp_path: Path) -> None:
    from headrace.rollout.engine.model import iter_safetensors
    from headrace.shared.weight_sync import EngineTarget, WeightSender, WeightSyncError

    (p0, u0), (p1, u1) = (start_engine(models[0], tmp_path / f"e{i}.log") for i in range(2))
    try:
        tensors = list(iter_safetensors(models[1]))
        timeout = 60 if fault == "killed" else 4
        sender = WeightSender([EngineTarget(u0), EngineTarget(u1)], bucket_bytes=16 << 10, timeout_s=timeout)
        sender.connect()
        act = p1.kill9 if fault == "killed" else (lambda: os.kill(p1.pid, signal.SIGSTOP))
        with pytest.raises(WeightSyncError) as err:
            sender.update(_iter_then(tensors, len(tensors) // 2, act), weight_version=8)
        assert err.value.urls == [u1] and u1 in str(err.value)
        assert model_version(u0) != "8"  # the survivor never claims the version it did not fully get
        sender._fanout.close()
        if fault == "hung":
            os.kill(p1.pid, signal.SIGCONT)
            p1.kill9()
        # the run goes on with the surviving engine: a fresh sender ends the stale session and
        # pushes the whole model; the survivor then computes model b
        with WeightSender([EngineTarget(u0)], bucket_bytes=16 << 10, timeout_s=60) as sender2:
            sender2.update(tensors, weight_version=9)
        assert model_version(u0) == "9"
        from tests.engine.engine_contract import hf_logprobs
        out = greedy(u0)
        ref = hf_logprobs(str(models[1]), PROMPT, out["output_ids"])
        for i, (lp, tid, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            assert abs(lp - float(ref[i, tid])) < 1e-3
    finally:
        if fault == "hung" and p1.alive():
            os.kill(p1.pid, signal.SIGCONT)
        p0.stop()
        p1.stop()
