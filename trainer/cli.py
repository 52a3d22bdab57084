"""``headrace train`` and ``headrace model ...``: argument parsing only; torch is imported when they run."""

from __future__ import annotations

from typing import Optional

import typer

model_app = typer.Typer(no_args_is_help=True, add_completion=False)


def train(
    config: str = typer.Option(..., help="run YAML"),
    buffer_url: Optional[str] = typer.Option(None, help="buffer URL (default buffer.url)"),
    rollout_url: Optional[str] = typer.Option(None, help="rollout URL; without it, train-only mode"),
) -> None:
    """Lease groups from the buffer, train, bump the policy version, ack."""
    raise typer.Exit("headrace train: not implemented yet")


@model_app.command("logprobs")
def logprobs(
    model: str = typer.Option(..., help="HF model directory"),
    tp: int = typer.Option(1, min=1, help="tensor-parallel size (processes, gloo)"),
    input: str = typer.Option(..., "--input", help='jsonl with {"tokens": [...]} per line'),
    output: str = typer.Option(..., "--output", help='jsonl with {"logprobs": [...]} per line'),
) -> None:
    """Per-token log-probabilities from the trainer's model at TP=N."""
    from trainer.logprobs_tool import run as run_logprobs

    try:
        n = run_logprobs(model, tp, input, output)
    except (OSError, ValueError, KeyError, RuntimeError, TimeoutError) as e:
        typer.echo(f"headrace model logprobs: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {n} lines to {output}", err=True)
