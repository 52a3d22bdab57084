"""PEFT LoRA directories for tests, written by the real ``peft`` library on the ``transformers`` model."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(model_dir: Path, out: Path, *, r: int = 4, alpha: float = 8.0,
                       targets: list[str] | None = None, seed: int = 0, merged_out: Path | None = None) -> Path:
    """A PEFT directory at ``out`` with random A and B (``init_lora_weights=False``: B is not 0, so the
    adapter changes the outputs); with ``merged_out`` also the merged model (``merge_and_unload``) there."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or ALL_TARGETS), init_lora_weights=False)
    model = get_peft_model(base, cfg)
    with torch.no_grad():   # B at a scale where the adapter moves logprobs clearly, as after some training
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(3.0)
    model.save_pretrained(str(out))
    if merged_out is not None:
        model.merge_and_unload().save_pretrained(str(merged_out))
    return out


async def parity_reward(ctx: object, sample: object) -> float:
    """A reward plugin that varies within a group (the parity of the last token), so GRPO's
    advantages are not all zero and a few steps move the adapters."""
    return float(sample.tokens[-1] % 2)   # type: ignore[attr-defined]
