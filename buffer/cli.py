"""``headrace buffer serve``: argument parsing only; the service is imported when it runs.

Precedence: flags > ``HEADRACE_BUFFER__*`` environment variables > ``--config FILE`` (its
``buffer`` section; other sections are validated and ignored) > the defaults of
``shared.config.BufferConfig``; a bad value is one error naming the key. ``headrace run`` and
``headrace launch`` start the buffer with ``--config <out>/config.yaml`` alone, so every
``buffer.*`` key of the run's YAML reaches it.

The token never travels on a command line (``ps`` shows command lines to every user): it is the
run's ``auth.token``, from ``HEADRACE_TOKEN``, ``auth.token_file`` or ``--token-file``; ``--token``
is refused. Binding a non-loopback address without a token is refused unless ``--insecure``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command("serve")
def serve(
    config: Optional[str] = typer.Option(None, help="run YAML; its buffer section configures the buffer"),
    host: Optional[str] = typer.Option(None, help="interface to bind (default buffer.host, 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, min=0, max=65535, help="TCP port (default buffer.port, 8100)"),
    db: Optional[str] = typer.Option(None, help="SQLite database file (durable; WAL mode) (default ./buffer.sqlite)"),
    memory: bool = typer.Option(False, "--memory", help="in-memory store: faster, not durable"),
    durability: Optional[str] = typer.Option(None, help="what an answered post survives: process_crash (kill -9; "
                                                        "default) or power_loss (also an OS crash: fsync per commit)"),
    capacity: Optional[int] = typer.Option(None, min=1, help="max queued + leased groups (429 beyond) (default 4096)"),
    max_staleness: Optional[int] = typer.Option(None, min=0, help="policy versions a group may lag before eviction (default 1)"),
    token_file: Optional[Path] = typer.Option(None, help="file holding the run's bearer token (auth.token; "
                                                         "or set HEADRACE_TOKEN)"),
    token: Optional[str] = typer.Option(None, hidden=True, help="refused: use --token-file"),
    max_body_mb: Optional[float] = typer.Option(None, min=0.001, help="largest request body in MiB (413 beyond) (default 64)"),
    insecure: bool = typer.Option(False, "--insecure", help="allow binding a non-loopback address without a token"),
    log_level: str = typer.Option("warning", help="uvicorn log level"),
) -> None:
    """Serve the buffer HTTP API."""
    from headrace.shared.auth import bind_refusal, flag_token
    from headrace.shared.config import UNSET, ConfigError, load_config

    if db and memory:
        raise typer.BadParameter("give either --db PATH or --memory, not both")
    try:
        secret = flag_token(token, token_file)
    except ValueError as e:
        typer.echo(f"headrace buffer serve: {e}", err=True)
        raise typer.Exit(2) from None
    overrides = {"buffer.host": host, "buffer.port": port, "buffer.capacity": capacity,
                 "buffer.max_staleness": max_staleness, "auth.token": secret, "buffer.max_body_mb": max_body_mb,
                 "buffer.durability": durability}
    if memory:                    # the flag wins over the file's storage choice
        overrides.update({"buffer.memory": True, "buffer.db": UNSET})
    elif db:
        overrides.update({"buffer.db": db, "buffer.memory": UNSET})
    try:
        run_cfg = load_config(config, overrides)
    except ConfigError as e:
        typer.echo(f"headrace buffer serve: {e}", err=True)
        raise typer.Exit(2) from None
    cfg, auth = run_cfg.buffer, run_cfg.auth
    refusal = bind_refusal(cfg.host, auth.token, insecure)
    if refusal:
        typer.echo(f"headrace buffer serve: {refusal}", err=True)
        raise typer.Exit(2)
    from headrace.buffer.app import serve as run_server

    where = "memory (not durable)" if cfg.memory else f"{cfg.db or 'buffer.sqlite'} (survives {cfg.durability})"
    typer.echo(f"headrace buffer: http://{cfg.host}:{cfg.port} store={where} capacity={cfg.capacity} "
               f"max_staleness={cfg.max_staleness} max_body_mb={cfg.max_body_mb:g} "
               f"auth={'on' if auth.token else 'off'}", err=True)
    run_server(cfg, log_level=log_level, auth=auth)
