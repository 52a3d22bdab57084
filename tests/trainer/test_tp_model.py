"""Vocab-parallel logprobs/entropy, TP=2 gradients, the process groups and the spawn launcher.

Everything runs for real: gloo process groups in processes started by ``trainer.launch.spawn``.
References are computed in the test process with full-vocabulary ``log_softmax`` and autograd, and
with transformers' model for the end-to-end gradient.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.support import odd_llama, packed, preset_model, token_seqs

TOL = 1e-4


# ----------------------------------------------------------------------------- single process
def _full_reference(logits: Any, targets: Any, temperature: float) -> tuple[Any, Any]:
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_and_entropy_match_full_softmax(temperature: float) -> None:
    import torch

    from headrace.trainer.model import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 37, generator=g) * 4
    targets = torch.randint(0, 37, (9,), generator=g)
    before = logits.clone()
    lp, ent = vocab_parallel_logprobs(logits, targets, temperature=temperature, with_entropy=True)
    ref_lp, ref_ent = _full_reference(logits, targets, temperature)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.equal(logits, before), "the input logits must not be modified"
    lp2, none = vocab_parallel_logprobs(logits, targets, temperature=temperature)
    assert none is None and torch.equal(lp2, lp)


def test_logprobs_gradcheck_fp64() -> None:
    import torch

    from headrace.trainer.model import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 11, generator=g, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, 11, (5,), generator=g)
    for temperature in (1.0, 0.7):
        def both(x: Any) -> tuple[Any, Any]:
            return vocab_parallel_logprobs(x, targets, temperature=temperature, with_entropy=True)

        def only_lp(x: Any) -> Any:
            return vocab_parallel_logprobs(x, targets, temperature=temperature)[0]

        assert torch.autograd.gradcheck(both, (logits,))
        assert torch.autograd.gradcheck(only_lp, (logits,))


def test_logprobs_reject_bad_shapes_and_temperature() -> None:
    import torch

    from headrace.trainer.model import vocab_parallel_logprobs

    with pytest.raises(ValueError, match="expected logits"):
        vocab_parallel_logprobs(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), temperature=0.0)


@pytest.mark.parametrize("lens", [(5, 5, 5), (7, 1, 12, 5), (40, 3, 3, 3, 3, 2, 9, 1)])
def test_packed_attention_matches_per_sequence_loop(lens: tuple[int, ...]) -> None:
    """Bucketed padded attention == one causal SDPA per sequence, values and gradients."""
    import torch
    import torch.nn.functional as F

    from headrace.trainer.model.attention import packed_causal_attention, plan

    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    g = torch.Generator().manual_seed(len(lens))
    q, k, v = (torch.randn(bounds[-1], 3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    p = plan(bounds, torch.device("cpu"))
    if len(lens) == 8:
        assert len(p.buckets) > 1, "a 40-token sequence must not pad the short ones"
    out = packed_causal_attention(q, k, v, p)
    ref = torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                                    is_causal=True).transpose(0, 1).reshape(b - a, -1)
                     for a, b in zip(bounds, bounds[1:])])
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


# ----------------------------------------------------------------------------- TP=2, logits only
def rank_vocab_parallel(logits: Any, targets: Any, g_lp: Any, g_ent: Any, temperature: float) -> dict[str, Any]:
    """Each rank takes its vocabulary slice (uneven: 6 + 5 of 11), computes, backpropagates."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from headrace.trainer.model import vocab_parallel_logprobs
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(2)
    V = logits.shape[1]
    start = [0, 6][info.tp_rank]
    stop = [6, V][info.tp_rank]
    shard = logits[:, start:stop].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(shard, targets, vocab_start=start, group=info.tp_group,
                                      temperature=temperature, with_entropy=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    # megatron-core's own vocab-parallel cross entropy (even shards only: pad to 12 with -inf)
    padded = torch.cat([logits, torch.full((logits.shape[0], 1), -1e30)], dim=1) / temperature
    mine = padded[:, info.tp_rank * 6:(info.tp_rank + 1) * 6].clone()
    megatron_lp = -vocab_parallel_cross_entropy(mine, targets)
    destroy_distributed()
    return {"lp": lp.detach(), "ent": ent.detach(), "grad": shard.grad, "megatron_lp": megatron_lp}


def test_vocab_parallel_tp2_matches_full_softmax_and_megatron() -> None:
    import torch

    from headrace.trainer.launch import spawn

    g = torch.Generator().manual_seed(2)
    T, V, temperature = 8, 11, 0.8
    logits = torch.randn(T, V, generator=g, dtype=torch.float32) * 3
    targets = torch.tensor([0, 5, 6, 10, 3, 7, 6, 5])            # both sides of the shard boundary
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    r0, r1 = spawn(rank_vocab_parallel, 2, logits, targets, g_lp, g_ent, temperature, timeout_s=300)

    x = logits.clone().requires_grad_()
    ref_lp, ref_ent = _full_reference(x, targets, temperature)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    for r in (r0, r1):
        assert torch.allclose(r["lp"], ref_lp.detach(), atol=1e-5)
        assert torch.allclose(r["ent"], ref_ent.detach(), atol=1e-5)
        assert torch.allclose(r["megatron_lp"], ref_lp.detach(), atol=1e-5)
    assert torch.allclose(torch.cat([r0["grad"], r1["grad"]], dim=1), x.grad, atol=1e-5)


# ----------------------------------------------------------------------------- TP=2, whole model
def rank_model_grads(tp: int, jobs: list[tuple[str, list[list[int]], Any]]) -> list[dict[str, Any]]:
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp)
    out = [_model_grads(info, *job) for job in jobs]
    destroy_distributed()
    return out


def _model_grads(info: Any, model_dir: str, seqs: list[list[int]], weights: Any) -> dict[str, Any]:
    """Loss = sum(w * logprob) + 0.1 * sum(entropy) over unmasked tokens; HF-named full gradients."""
    import torch

    from headrace.trainer.model import load_model

    model = load_model(model_dir, info)
    ids, pos, cu, targets, mask = packed(seqs)
    lp, ent = model.token_logprobs(ids, pos, cu, targets, with_entropy=True)
    loss = ((lp * weights + 0.1 * ent) * mask).sum()
    loss.backward()
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from headrace.trainer.model.loading import param_specs

    specs = param_specs(model)
    for name, p in model.named_parameters():     # megatron's own duplicate test agrees with our specs
        assert param_is_not_tensor_parallel_duplicate(p, info.tp_group) == (specs[name].mode != "rep" or info.tp_rank == 0)
    errors = {}
    for label, call in {"vocab": lambda: model.token_logprobs(ids + 10**6, pos, cu, targets),
                        "target": lambda: model.token_logprobs(ids, pos, cu, targets * 0 - 1),
                        "cu": lambda: model(ids, pos, torch.tensor([0, 3, 2, len(ids)]))}.items():
        try:
            call()
        except ValueError as e:
            errors[label] = str(e)
    with torch.no_grad():                      # reuse the exporter to gather gradients by HF name
        for p in model.parameters():
            p.copy_(p.grad)
        grads = dict(model.hf_state_dict())
    return {"loss": loss.item(), "grads": grads, "errors": errors}


def _hf_grads(model_dir: Path, seqs: list[list[int]], weights: Any) -> tuple[float, dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _, _, cu, targets, mask = packed(seqs)
    total = 0.0
    for i, s in enumerate(seqs):
        a, b = int(cu[i]), int(cu[i + 1])
        logp = hf(torch.tensor([s])).logits[0].log_softmax(-1)
        lp = logp.gather(-1, targets[a:b, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        loss = ((lp * weights[a:b] + 0.1 * ent) * mask[a:b]).sum()
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in hf.named_parameters()}


@pytest.fixture(scope="module")
def grad_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grads")
    return {"tiny-qwen2": preset_model("tiny-qwen2", root / "q", seed=4), "odd-llama": odd_llama(root / "o", seed=2),
            "qwen3-tiny": preset_model("qwen3-tiny", root / "q3", seed=5)}  # per-head q/k norm split over TP


def test_model_gradients_tp2_match_tp1_and_transformers(grad_models: dict[str, Path]) -> None:
    import json

    import torch

    from headrace.trainer.launch import spawn

    jobs = []
    for name, d in grad_models.items():
        vocab = json.loads((d / "config.json").read_text())["vocab_size"]
        seqs = token_seqs(vocab, (6, 10, 1, 4), seed=7)
        weights = torch.randn(sum(map(len, seqs)), generator=torch.Generator().manual_seed(3))
        jobs.append((str(d), seqs, weights))
    tp1 = spawn(rank_model_grads, 1, 1, jobs)[0]
    tp2 = spawn(rank_model_grads, 2, 2, jobs)
    for j, (name, d) in enumerate(grad_models.items()):
        _, seqs, weights = jobs[j]
        ref_loss, ref = _hf_grads(d, seqs, weights)
        assert tp2[1][j]["grads"] == {}, "only TP rank 0 yields exported tensors"
        for label, res in (("TP=1", tp1[j]), ("TP=2", tp2[0][j])):
            assert abs(res["loss"] - ref_loss) < TOL * max(1.0, abs(ref_loss)), f"{label} {name}"
            ours = res["grads"]
            hf_names = {n for n in ref if not (n == "lm_head.weight" and "lm_head.weight" not in ours)}
            assert set(ours) == hf_names, f"{label} {name}"
            for n, gref in ref.items():
                if n not in ours:
                    continue                               # tied lm_head: its gradient is in the embedding
                scale = max(1.0, gref.abs().max().item())
                err = (ours[n] - gref).abs().max().item()
                assert err < TOL * scale, f"{label} {name}: gradient of {n} differs by {err} (scale {scale})"
        for res in (tp1[j], tp2[0][j], tp2[1][j]):
            assert "outside the vocabulary" in res["errors"]["vocab"]
            assert "target id -1" in res["errors"]["target"]
            assert "cu_seqlens" in res["errors"]["cu"]


# ----------------------------------------------------------------------------- groups and launcher
def rank_groups(tp: int, dp: int) -> tuple[int, int, int, float, float]:
    import torch
    import torch.distributed as dist

    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp, dp)
    x = torch.tensor([float(info.rank)])
    y = x.clone()
    dist.all_reduce(x, group=info.tp_group)
    dist.all_reduce(y, group=info.dp_group)
    out = (info.rank, info.tp_rank, info.dp_rank, x.item(), y.item())
    destroy_distributed()
    return out


@pytest.mark.slow
def test_tp2_dp2_group_layout() -> None:
    from headrace.trainer.launch import spawn

    got = spawn(rank_groups, 4, 2, 2)
    # Megatron layout: TP groups [0,1] and [2,3]; DP groups [0,2] and [1,3]
    assert got == [(0, 0, 0, 1.0, 2.0), (1, 1, 0, 1.0, 4.0), (2, 0, 1, 5.0, 2.0), (3, 1, 1, 5.0, 4.0)]


def test_dp2_groups() -> None:
    from headrace.trainer.launch import spawn

    assert spawn(rank_groups, 2, 1, 2) == [(0, 0, 0, 0.0, 1.0), (1, 0, 1, 1.0, 1.0)]


def test_world_size_mismatch_is_refused_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    from headrace.trainer.parallel import init_distributed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 but tp\*dp = 2\*2 = 4"):
        init_distributed(2, 2)
    with pytest.raises(ValueError, match="must both be >= 1"):
        init_distributed(0)


def rank_fails_on_one(bad_rank: int, how: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")       # plain torch.distributed: the launcher alone is under test
    rank = dist.get_rank()
    if rank == bad_rank:
        if how == "raise":
            raise ValueError(f"deliberate failure on rank {rank}")
        os._exit(3)
    dist.barrier()            # the healthy rank blocks here until the launcher ends it
    return rank


def test_spawn_reports_the_failing_rank() -> None:
    from headrace.trainer.launch import spawn

    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*ValueError: deliberate failure on rank 1"):
        spawn(rank_fails_on_one, 2, 1, "raise", timeout_s=120)
    with pytest.raises(RuntimeError, match="rank 0 of 2 exited with code 3 without a result"):
        spawn(rank_fails_on_one, 2, 0, "exit", timeout_s=120)


def rank_flat_layout(model_dir: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from headrace.shared.weight_sync import contiguous_run
    from headrace.trainer.model import load_model
    from headrace.trainer.model.loading import param_specs
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(1)
    try:
        model = load_model(model_dir, info)
        params = dict(model.named_parameters())
        in_order = [params[n] for n in param_specs(model)]
        exported = list(model.hf_state_dict(copy=False))
        disk = load_file(str(Path(model_dir) / "model.safetensors"))
        same_values = all(torch.equal(t, disk[n]) for n, t in exported)
        whole = contiguous_run([t for _, t in exported])
        ptrs = [p.data_ptr() for p in in_order]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.tensor([1, 5, 9, 3])
        lp, _ = model.token_logprobs(ids, torch.arange(4), torch.tensor([0, 4]), torch.tensor([5, 9, 3, 0]))
        lp.sum().backward()
        opt.step()
        after = dict(model.hf_state_dict(copy=False))
        return {"params_run": contiguous_run([p.detach() for p in in_order]) is not None,
                "export_run": whole is not None and whole.numel() == sum(t.numel() for _, t in exported),
                "same_values": same_values, "storage_kept": ptrs == [p.data_ptr() for p in in_order],
                "step_changed_export": any(not torch.equal(after[n], disk[n]) for n in disk if n in after),
                "export_still_run": contiguous_run(list(after.values())) is not None}
    finally:
        destroy_distributed()


@pytest.mark.parametrize("preset", ["tiny-qwen2", "odd-llama"])
def test_tp1_parameters_lie_back_to_back_in_export_order(preset: str, tmp_path: Path) -> None:
    """At TP 1 ``load_model`` lays the parameters out in one buffer in export order: the exported
    tensors (views, ``copy=False``) are one run of it with the file's values, and an optimizer step
    updates them in place (the layout survives training; weight sync then sends whole buckets
    straight from the parameters)."""
    from headrace.trainer.launch import spawn

    d = preset_model("tiny-qwen2", tmp_path / "m", seed=3) if preset == "tiny-qwen2" else odd_llama(tmp_path / "m", seed=3)
    got = spawn(rank_flat_layout, 1, str(d), timeout_s=300)[0]
    assert got == {"params_run": True, "export_run": True, "same_values": True, "storage_kept": True,
                   "step_changed_export": True, "export_still_run": True}
