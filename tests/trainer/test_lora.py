"""LoRA on the TP decoder: TP=1 and TP=2 agree with each other and with ``peft`` on the
transformers model (logprobs and adapter gradients, 1e-5 in fp32); the PEFT export loads with the
real ``peft.PeftModel.from_pretrained`` and gives the trainer's logits; the merged export keeps every
non-targeted tensor bit-identical to the base; bad adapters and ranks are refused.

Everything runs for real: gloo process groups in processes started by ``trainer.launch.spawn``,
the real ``peft`` and ``transformers`` in the test process. One spawn per TP size for every check
(~45 s on the 2-core machine, shared by the two slow tests).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.support import odd_llama, packed, preset_model, token_seqs

TOL = 1e-5
RANK, ALPHA = 4, 12.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_cfg(targets: list[str] = TARGETS) -> Any:
    from headrace.shared.config_sections import LoRAConfig

    return LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets)


def _random_adapter(model_dir: Path, targets: list[str], seed: int) -> dict[str, Any]:
    """Full PEFT-named adapter tensors with B != 0 (so the adapters change the logits)."""
    import torch

    from headrace.trainer.lora import peft_names

    c = json.loads((model_dir / "config.json").read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    io = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
          "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(c["num_hidden_layers"]):
        for t in targets:
            i, o = io[t]
            a, b = peft_names(layer, t)
            out[a] = torch.randn(RANK, i, generator=g) * 0.2
            out[b] = torch.randn(o, RANK, generator=g) * 0.2
    return out


# ----------------------------------------------------------------------------- ranks
def rank_lora(tp: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from headrace.trainer.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp)
    try:
        return [_lora_job(info, **job) for job in jobs]
    finally:
        destroy_distributed()


def _lora_job(info: Any, model_dir: str, seqs: list[list[int]], weights: Any, adapter: dict[str, Any],
              targets: list[str], out: str | None) -> dict[str, Any]:
    import torch

    from headrace.shared.config import load_config
    from headrace.trainer.lora import AdaptersOff, adapter_tensors, apply_lora, load_adapter_tensors
    from headrace.trainer.lora_export import save_merged_hf, save_peft_adapter
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, clip_grad_norm

    cfg = _lora_cfg(targets)
    model = load_model(model_dir, info)
    ids, pos, cu, targets_ids, mask = packed(seqs)
    with torch.no_grad():
        base_lp = model.token_logprobs(ids, pos, cu, targets_ids)[0]
    apply_lora(model, cfg, base_path=model_dir, seed=3)
    with torch.no_grad():   # step 0 (B = 0) is the base model
        init_lp = model.token_logprobs(ids, pos, cu, targets_ids)[0]
    load_adapter_tensors(model, adapter)
    lp, ent = model.token_logprobs(ids, pos, cu, targets_ids, with_entropy=True)
    loss = ((lp * weights + 0.1 * ent) * mask).sum()
    loss.backward()
    res: dict[str, Any] = {"loss": loss.item(), "lp": lp.detach(), "init_equal": torch.equal(init_lp, base_lp)}
    res["base_grads"] = [n for n, p in model.named_parameters() if p.grad is not None and ".lora." not in n]
    res["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = build_optimizer(model, load_config(overrides={"trainer.weight_decay": 0.1}).trainer)
    res["opt_params"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
    res["grad_norm"] = clip_grad_norm(model, 0.0, info.tp_group, info.tp, info.tp_rank)
    with torch.no_grad():
        ref_lp = AdaptersOff(model).token_logprobs(ids, pos, cu, targets_ids)[0]
    res["ref_is_base"] = bool(torch.allclose(ref_lp, base_lp, atol=1e-6))
    with torch.no_grad():    # gather the adapters' gradients by PEFT name through the exporter
        saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(p.grad)
        res["grads"] = dict(adapter_tensors(model))
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(saved[n])
    res["adapter_back"] = dict(adapter_tensors(model))
    if out is not None:
        save_peft_adapter(model, Path(out) / "hf-lora", base_model_path=model_dir, lora_cfg=cfg)
        save_merged_hf(model, Path(out) / "hf", model_dir)
        with torch.no_grad():
            res["logits"] = model(ids, pos, cu)
    errors = {}
    for label, call in {"missing": lambda: load_adapter_tensors(model, {k: v for k, v in list(adapter.items())[1:]}),
                        "shape": lambda: load_adapter_tensors(model, {k: v[:1] for k, v in adapter.items()}),
                        "again": lambda: apply_lora(model, cfg, base_path=model_dir),
                        "rank": lambda: apply_lora(load_model(model_dir, info),
                                                   type(cfg)(rank=4096, target_modules=targets), base_path=model_dir)}.items():
        try:
            call()
        except (KeyError, ValueError) as e:
            errors[label] = str(e)
    res["errors"] = errors
    return res


# ----------------------------------------------------------------------------- references
def _peft_model(model_dir: Path, adapter: dict[str, Any], targets: list[str]) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    missing = set_peft_model_state_dict(pm, adapter)
    assert not missing.unexpected_keys
    return pm


def _peft_lp_grads(pm: Any, seqs: list[list[int]], weights: Any) -> tuple[float, Any, dict[str, Any]]:
    import torch

    _, _, cu, targets, mask = packed(seqs)
    total, lps = 0.0, []
    for i, s in enumerate(seqs):
        a, b = int(cu[i]), int(cu[i + 1])
        logp = pm(input_ids=torch.tensor([s])).logits[0].log_softmax(-1)
        lp = logp.gather(-1, targets[a:b, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        loss = ((lp * weights[a:b] + 0.1 * ent) * mask[a:b]).sum()
        loss.backward()
        total += loss.item()
        lps.append(lp.detach())
    grads = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    return total, torch.cat(lps), grads


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch

    from headrace.trainer.launch import spawn

    root = tmp_path_factory.mktemp("lora")
    models = {"odd-llama": (odd_llama(root / "o", seed=2), TARGETS),   # TP=2 pads heads and MLP units
              "tiny-qwen2": (preset_model("tiny-qwen2", root / "q", seed=4), ["q_proj", "v_proj", "down_proj"])}
    jobs = []
    for name, (d, targets) in models.items():
        vocab = json.loads((d / "config.json").read_text())["vocab_size"]
        seqs = token_seqs(vocab, (6, 10, 1, 4), seed=7)
        weights = torch.randn(sum(map(len, seqs)), generator=torch.Generator().manual_seed(3))
        jobs.append({"model_dir": str(d), "seqs": seqs, "weights": weights, "adapter": _random_adapter(d, targets, 5),
                     "targets": targets, "out": str(root / f"out-{name}")})
    tp1 = spawn(rank_lora, 1, 1, [{**j, "out": None} for j in jobs], timeout_s=400)[0]
    tp2 = spawn(rank_lora, 2, 2, jobs, timeout_s=400)
    return {"models": models, "jobs": jobs, "tp1": tp1, "tp2": tp2}


def _close(a: Any, b: Any, what: str) -> None:
    scale = max(1.0, b.abs().max().item())
    err = (a - b).abs().max().item()
    assert err < TOL * scale, f"{what} differs by {err} (scale {scale})"


@pytest.mark.slow
def test_lora_tp1_tp2_and_peft_agree(lora_runs: dict[str, Any]) -> None:
    for j, (name, (d, targets)) in enumerate(lora_runs["models"].items()):
        job = lora_runs["jobs"][j]
        pm = _peft_model(d, job["adapter"], targets)
        ref_loss, ref_lp, ref_grads = _peft_lp_grads(pm, job["seqs"], job["weights"])
        for label, res in (("TP=1", lora_runs["tp1"][j]), ("TP=2 rank 0", lora_runs["tp2"][0][j]),
                           ("TP=2 rank 1", lora_runs["tp2"][1][j])):
            assert res["init_equal"], f"{label} {name}: B = 0 must leave the base model's logprobs unchanged"
            assert res["ref_is_base"], f"{label} {name}: the KL reference must be the base"
            assert res["base_grads"] == [], f"{label} {name}: the base is frozen"
            assert res["opt_params"] == res["trainable"], f"{label} {name}: the optimizer holds the adapters only"
            assert abs(res["loss"] - ref_loss) < TOL * max(1.0, abs(ref_loss)), f"{label} {name}"
            _close(res["lp"], ref_lp, f"{label} {name}: logprobs")
            assert res["errors"]["missing"].startswith("'adapter tensor") and "missing" in res["errors"]["missing"]
            assert "has shape" in res["errors"]["shape"]
            assert "already has LoRA" in res["errors"]["again"]
            assert "exceeds the smaller dimension" in res["errors"]["rank"]
        assert lora_runs["tp2"][1][j]["grads"] == {}, "only TP rank 0 yields gathered adapters"
        assert abs(lora_runs["tp1"][j]["grad_norm"] - lora_runs["tp2"][0][j]["grad_norm"]) < 1e-4 * lora_runs["tp1"][j]["grad_norm"]
        for label, res in (("TP=1", lora_runs["tp1"][j]), ("TP=2", lora_runs["tp2"][0][j])):
            assert set(res["grads"]) == set(ref_grads), f"{label} {name}"
            for n, g in ref_grads.items():
                _close(res["grads"][n], g, f"{label} {name}: gradient of {n}")
            for n, t in job["adapter"].items():   # load -> gather is exact (padding dropped)
                assert res["adapter_back"][n].equal(t), f"{label} {name}: {n} after load and gather"


@pytest.mark.slow
def test_peft_export_loads_with_peft_and_merged_export_keeps_the_base(lora_runs: dict[str, Any]) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from headrace.trainer.lora import peft_names

    for j, (name, (d, targets)) in enumerate(lora_runs["models"].items()):
        job, res = lora_runs["jobs"][j], lora_runs["tp2"][0][j]
        out = Path(job["out"])
        conf = json.loads((out / "hf-lora" / "adapter_config.json").read_text())
        assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"], conf["lora_dropout"]) == \
               ("LORA", "CAUSAL_LM", RANK, ALPHA, 0.0)
        assert conf["target_modules"] == targets and conf["base_model_name_or_path"] == str(d)
        saved = load_file(str(out / "hf-lora" / "adapter_model.safetensors"))
        layers = range(json.loads((d / "config.json").read_text())["num_hidden_layers"])
        assert set(saved) == {n for layer in layers for t in targets for n in peft_names(layer, t)}
        base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        pm = PeftModel.from_pretrained(base, out / "hf-lora")
        ids, pos, cu, _, _ = packed(job["seqs"])
        merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
        with torch.no_grad():
            for i in range(len(job["seqs"])):
                a, b = int(cu[i]), int(cu[i + 1])
                ref = pm(input_ids=ids[None, a:b]).logits[0]
                vocab = ref.shape[-1]
                half = res["logits"].shape[-1]   # TP rank 0's vocabulary shard
                _close(res["logits"][a:b], ref[:, :half], f"{name}: TP=2 logits vs PeftModel.from_pretrained")
                _close(merged(input_ids=ids[None, a:b]).logits[0], ref, f"{name}: merged export vs peft")
                assert vocab >= half
        base_sd, merged_sd = load_file(str(d / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
        assert set(base_sd) == set(merged_sd)
        hit = {f"model.layers.{layer}.{'mlp' if 'gate' in t or 'up_' in t or 'down' in t else 'self_attn'}.{t}.weight"
               for layer in layers for t in targets}
        for n, t in base_sd.items():
            if n in hit:
                assert merged_sd[n].dtype == t.dtype and not merged_sd[n].equal(t), n
            else:
                assert merged_sd[n].dtype == t.dtype and merged_sd[n].equal(t), f"{n} must be bit-identical to the base"


def test_lora_config_errors_name_the_key() -> None:
    from headrace.shared.config import ConfigError, load_config

    cfg = load_config(overrides={"trainer.lora": {"rank": 8}})
    assert cfg.trainer.lora.scaling == 2.0 and cfg.trainer.lora.target_modules == TARGETS
    assert load_config().trainer.lora is None, "full fine-tuning by default"
    cases = {"trainer.lora.rank": {"trainer.lora": {"rank": 0}},
             "trainer.lora.alpha": {"trainer.lora": {"alpha": -1}},
             "trainer.lora.dropout": {"trainer.lora": {"dropout": 1.0}},
             "valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj":
                 {"trainer.lora": {"target_modules": ["q_proj", "qkv_proj", "lm_head"]}},
             "trainer.lora_sync is adapter but trainer.lora is null": {"trainer.lora_sync": "adapter"},
             "trainer.weight_sync_hook is set": {"trainer.lora": {}, "trainer.lora_sync": "adapter",
                                                 "trainer.weight_sync_hook": "m:f"}}
    for needle, over in cases.items():
        with pytest.raises(ConfigError, match="invalid configuration") as e:
            load_config(overrides=over)
        assert needle in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides={"trainer.lora": {"target_modules": ["q_proj", "qkv_proj", "lm_head"]}})
    assert "['qkv_proj', 'lm_head']" in str(e.value) and str(e.value).count("\n") == 1, "one error listing both"
