"""``headrace engine serve``: argument parsing only; torch is imported when it runs."""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command("serve")
def serve(
    model: str = typer.Option(..., help="HF model directory"),
    host: str = typer.Option("127.0.0.1", help="interface to bind"),
    port: int = typer.Option(30000, min=0, max=65535, help="TCP port"),
    dtype: str = typer.Option("auto", help="auto (= float32 on CPU) | float32 | bfloat16 | float16"),
    threads: Optional[int] = typer.Option(None, min=1, max=512, help="torch intra-op threads (default: torch's)"),
    seed: int = typer.Option(0, min=0, help="seed of the sampler for requests without sampling_seed"),
    max_running_requests: int = typer.Option(256, min=1, max=65536, help="sequences decoded together at most"),
    max_prefill_tokens: int = typer.Option(8192, min=16, help="padded tokens per batched prefill at most"),
    batch_wait_ms: float = typer.Option(20.0, min=0.0, max=1000.0,
                                        help="from idle, wait until arrivals pause this long before prefilling"),
    weight_version: str = typer.Option("default", help="initial weight_version (SGLang's default is 'default')"),
    logprob_mode: str = typer.Option(
        "temperature", help="reported logprobs: temperature (SGLang's default: log softmax(logits/T)), "
                            "original (pre-temperature), processed (after top-k/top-p, renormalised)"),
    weight_sync_timeout: float = typer.Option(600.0, min=1.0, help="seconds for joining the weight-sync group"),
    allowed_weight_dirs: Optional[list[str]] = typer.Option(
        None, help="directories /update_weights_from_disk may load from besides the model directory (repeatable; "
                   "resolved: no escape through .. or symlinks); anything else is 403"),
    max_body_mb: float = typer.Option(64.0, min=0.001, max=4096.0, help="largest request body in MiB (413 beyond)"),
    max_batch: int = typer.Option(4096, min=1, max=1_000_000, help="most sequences (prompts x n) in one /generate "
                                  "(422 beyond)"),
    max_queued: int = typer.Option(4096, min=1, max=1_000_000, help="most /generate requests waiting for their "
                                   "answer (429 with Retry-After beyond)"),
    parent_pid: Optional[int] = typer.Option(None, min=1, help="stop when this process (the launcher) is gone"),
    token_file: Optional[str] = typer.Option(None, help="file holding the run's bearer token (auth.token; "
                                                        "or set HEADRACE_TOKEN)"),
    token: Optional[str] = typer.Option(None, hidden=True, help="refused: use --token-file"),
    insecure: bool = typer.Option(False, "--insecure", help="allow binding a non-loopback address without a token"),
    log_level: str = typer.Option("warning", help="uvicorn log level"),
) -> None:
    """Serve the reference engine (SGLang 0.5.23 HTTP API subset)."""
    from pathlib import Path

    from headrace.shared.auth import bind_refusal, flag_token
    from headrace.shared.config import ConfigError, load_config

    try:
        auth = load_config(None, {"auth.token": flag_token(token, token_file)}).auth
    except (ValueError, ConfigError) as e:   # ConfigError is a ValueError
        typer.echo(f"headrace engine serve: {e}", err=True)
        raise typer.Exit(2) from None
    refusal = bind_refusal(host, auth.token, insecure)
    if refusal:
        typer.echo(f"headrace engine serve: {refusal}", err=True)
        raise typer.Exit(2)

    if not (Path(model) / "config.json").is_file():
        raise typer.BadParameter(f"{model} is not a Hugging Face model directory (no config.json)", param_hint="--model")
    if logprob_mode not in ("temperature", "original", "processed"):
        raise typer.BadParameter("must be temperature, original or processed", param_hint="--logprob-mode")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise typer.BadParameter("must be auto, float32, bfloat16 or float16", param_hint="--dtype")
    from headrace.rollout.engine.server import serve as run

    run(model, host=host, port=port, threads=threads, log_level=log_level, dtype=dtype, seed=seed,
        max_running_requests=max_running_requests, max_prefill_tokens=max_prefill_tokens,
        weight_version=weight_version, logprob_mode=logprob_mode, weight_sync_timeout_s=weight_sync_timeout,
        batch_wait_ms=batch_wait_ms, allowed_weight_dirs=tuple(allowed_weight_dirs or ()), max_body_mb=max_body_mb,
        max_batch=max_batch, max_queued=max_queued, parent_pid=parent_pid, auth=auth)
