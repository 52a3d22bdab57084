"""Reference logprobs for the vLLM weight-sync tests: a ``transformers`` forward pass of the same
weights, and deterministic perturbations of a model (tied embeddings stay tied)."""

from __future__ import annotations

from pathlib import Path

import torch


def perturbed(model_dir: Path, seed: int | None) -> torch.nn.Module:
    """The model of ``model_dir``, every parameter moved by seeded noise (``seed`` None: as saved)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.add_(torch.randn(p.shape, generator=g) * (0.05 * float(p.std()) + 0.02))
    return model


def teacher_forced(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under ``model`` at temperature 1."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))
