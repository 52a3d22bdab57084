"""``headrace train`` and ``headrace model ...``: argument parsing only; torch is imported when they run."""

from __future__ import annotations

from typing import List, Optional

import typer

model_app = typer.Typer(no_args_is_help=True, add_completion=False)


def train(
    config: str = typer.Option(..., help="run YAML"),
    buffer_url: Optional[str] = typer.Option(None, help="buffer URL (default buffer.url)"),
    rollout_url: Optional[List[str]] = typer.Option(
        None, metavar="URL", help="rollout URL; without it, train-only mode. Repeat it for several rollout services "
                                  "on one buffer (each with its own rollout.data.shard): one weight sync covers all "
                                  "their engines"),
    token_file: Optional[str] = typer.Option(None, help="file holding the run's bearer token (auth.token; "
                                                        "or set HEADRACE_TOKEN)"),
    token: Optional[str] = typer.Option(None, hidden=True, help="refused: use --token-file"),
) -> None:
    """Lease groups from the buffer, train, bump the policy version, ack."""
    import os
    import sys
    from pathlib import Path

    from headrace.shared.auth import flag_token
    from headrace.shared.config import load_config, save_config

    urls = [u.rstrip("/") for u in rollout_url or []]
    if len(set(urls)) != len(urls):
        typer.echo(f"headrace train: --rollout-url given twice for the same service: {', '.join(urls)}", err=True)
        raise typer.Exit(2)
    try:   # the token reaches the ranks inside the config they are spawned with, never a file or argv
        cfg = load_config(config, {"buffer.url": buffer_url, "rollout.url": urls[0] if urls else None,
                                   "rollout.extra_urls": urls[1:] if urls else None,
                                   "auth.token": flag_token(token, token_file)})
    except ValueError as e:   # ConfigError, or --token / an unreadable --token-file
        typer.echo(f"headrace train: {e}", err=True)
        raise typer.Exit(2) from None
    t = cfg.trainer
    world = t.tp * t.dp
    threads = t.threads or max(1, (os.cpu_count() or 1) // world)
    save_config(cfg, Path(cfg.run.out) / "trainer_config.yaml")
    from headrace.trainer.launch import Lazy, spawn

    run_training_from_dict = Lazy("headrace.trainer.loop", "run_training_from_dict")  # imported by the ranks

    mode = f"rollout at {', '.join(urls)}" if urls else "train-only (no rollout URL)"
    typer.echo(f"headrace train: {world} rank(s) (tp={t.tp} dp={t.dp}, {threads} thread(s) each), "
               f"buffer {cfg.buffer.url}, {mode}", err=True)
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # one rank of an outside launcher (Ray, torchrun)
            if int(os.environ["WORLD_SIZE"]) != world:
                typer.echo(f"headrace train: WORLD_SIZE={os.environ['WORLD_SIZE']} but trainer.tp x trainer.dp = {world}", err=True)
                raise typer.Exit(2)
            import torch

            torch.set_num_threads(threads)
            results = [run_training_from_dict(cfg.model_dump(mode="json"), cfg.buffer.url, urls or None)]
        else:
            results = spawn(run_training_from_dict, world, cfg.model_dump(mode="json"), cfg.buffer.url, urls or None,
                            timeout_s=365 * 24 * 3600.0, threads=threads)
    except (RuntimeError, TimeoutError) as e:
        text = str(e).rstrip()
        last = text.splitlines()[-1] if text else repr(e)
        print(text, file=sys.stderr)
        typer.echo(f"headrace train: failed: {last}", err=True)
        raise typer.Exit(1) from None
    r = results[0]
    how = "stopped on request (SIGTERM) at step" if r.get("stopped") else "done at step"
    typer.echo(f"headrace train: {how} {r['step']}, policy version {r['policy_version']}, "
               f"{r['groups_consumed']} groups consumed", err=True)


@model_app.command("logprobs")
def logprobs(
    model: str = typer.Option(..., help="HF model directory"),
    tp: int = typer.Option(1, min=1, help="tensor-parallel size (processes, gloo)"),
    input: str = typer.Option(..., "--input", help='jsonl with {"tokens": [...]} per line'),
    output: str = typer.Option(..., "--output", help='jsonl with {"logprobs": [...]} per line'),
) -> None:
    """Per-token log-probabilities from the trainer's model at TP=N."""
    from headrace.trainer.logprobs_tool import run as run_logprobs

    try:
        n = run_logprobs(model, tp, input, output)
    except (OSError, ValueError, KeyError, RuntimeError, TimeoutError) as e:
        typer.echo(f"headrace model logprobs: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {n} lines to {output}", err=True)
