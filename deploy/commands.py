"""Commands of the deploy layer: ``run``, ``launch``, ``init-model`` (parsing only; lazy imports)."""

from __future__ import annotations

from typing import Optional

import typer


def run(
    config: Optional[str] = typer.Option(None, help="run YAML (default: the built-in CPU demo)"),
    out: Optional[str] = typer.Option(None, help="output directory (default run.out)"),
) -> None:
    """Start buffer, engines, rollout and trainer on this machine and train."""
    raise typer.Exit("headrace run: not implemented yet")


def launch(
    config: str = typer.Option(..., help="run YAML"),
    placement: str = typer.Option(..., help="colocated | disaggregated"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the placement plan as JSON and exit"),
    assume_gpus: Optional[int] = typer.Option(None, min=1, help="with --dry-run: one imaginary node of N GPUs"),
) -> None:
    """Launch the services on a Ray cluster."""
    raise typer.Exit("headrace launch: not implemented yet")


def init_model(
    preset: str = typer.Option(..., help="preset name, e.g. tiny-qwen2, tiny-llama"),
    out: str = typer.Option(..., help="output directory"),
) -> None:
    """Write a small HF model directory (config, safetensors, tokenizer) offline."""
    raise typer.Exit("headrace init-model: not implemented yet")
