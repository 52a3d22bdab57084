"""Commands of the deploy layer: ``run``, ``launch``, ``init-model``, ``config`` (parsing only; lazy imports)."""

from __future__ import annotations

from typing import Optional

import typer


def run(
    config: Optional[str] = typer.Option(None, help="run YAML (default: the built-in CPU demo)"),
    out: Optional[str] = typer.Option(None, help="output directory (default run.out)"),
    resume: Optional[str] = typer.Option(None, help="continue the run in this directory from its last checkpoint"),
) -> None:
    """Start buffer, engines, rollout and trainer on this machine and train."""
    from headrace.deploy.local import run_local
    from headrace.shared.config import ConfigError

    try:
        code = run_local(config, out, resume)
    except (ConfigError, FileNotFoundError) as e:
        typer.echo(f"headrace run: {e}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(code)


def launch(
    config: str = typer.Option(..., help="run YAML"),
    placement: str = typer.Option(..., help="colocated | disaggregated"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the placement plan as JSON and exit"),
    assume_gpus: Optional[int] = typer.Option(None, min=1, help="with --dry-run: one imaginary node of N GPUs"),
) -> None:
    """Launch the services on a Ray cluster."""
    import json

    from headrace.deploy.plan import PlanError, assumed_nodes, make_plan
    from headrace.shared.config import ConfigError, check_full_run, load_config

    try:
        cfg = load_config(config)
        check_full_run(cfg)
        from headrace.deploy.ray_launch import check_launchable

        check_launchable(cfg)
        if dry_run and assume_gpus is not None:
            plan = make_plan(cfg, placement, assumed_nodes(assume_gpus))  # type: ignore[arg-type]
            typer.echo(json.dumps(plan.to_json(), indent=2))
            return
        from headrace.deploy.ray_launch import launch_on_ray

        launch_on_ray(cfg, placement, dry_run=dry_run)  # type: ignore[arg-type]
    except (ConfigError, PlanError) as e:
        typer.echo(f"headrace launch: {e}", err=True)
        raise typer.Exit(2)


def init_model(
    preset: str = typer.Option(..., help="preset name: tiny-qwen2, tiny-qwen2-tools, tiny-llama, micro-qwen2, qwen2-5m, "
                                         "qwen3-tiny, llama-5m, smollm2-135m"),
    out: str = typer.Option(..., help="output directory"),
    seed: int = typer.Option(0, min=0, help="seed of the random initialisation (random presets)"),
) -> None:
    """Write a small HF model directory (config, safetensors, tokenizer) offline."""
    from headrace.shared.modelzoo import describe, init_model as write_model, presets

    if preset not in presets():
        typer.echo(f"headrace init-model: unknown preset {preset!r}; available: {', '.join(presets())}", err=True)
        raise typer.Exit(2)
    try:
        path = write_model(preset, out, seed=seed)
    except (ValueError, FileNotFoundError, OSError) as e:
        typer.echo(f"headrace init-model: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {preset} ({describe(preset)}) to {path}")


def config(
    reference: bool = typer.Option(False, "--reference", help="print every config key with its description, "
                                                              "as Markdown (docs/config.md)"),
    check: Optional[str] = typer.Option(None, help="validate this run YAML (with HEADRACE_* overrides) and print "
                                                   "it resolved, every key with its value"),
) -> None:
    """The configuration: its reference, or one file checked and resolved."""
    from headrace.shared.config import ConfigError, load_config, redacted
    from headrace.shared.config_reference import config_reference

    if reference == (check is not None):
        typer.echo("headrace config: give --reference or --check FILE", err=True)
        raise typer.Exit(2)
    if reference:
        typer.echo(config_reference(), nl=False)
        return
    import yaml

    try:
        cfg = load_config(check)
    except ConfigError as e:
        typer.echo(f"headrace config: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(yaml.safe_dump(redacted(cfg), sort_keys=False), nl=False)
