"""``headrace buffer serve``: argument parsing only; the service is imported when it runs.

Flags override ``HEADRACE_BUFFER__*`` environment variables, which override the defaults of
``shared.config.BufferConfig``; a bad value is one error naming the key.
"""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command("serve")
def serve(
    host: Optional[str] = typer.Option(None, help="interface to bind (default 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, min=0, max=65535, help="TCP port (default 8100)"),
    db: Optional[str] = typer.Option(None, help="SQLite database file (durable; WAL mode) (default ./buffer.sqlite)"),
    memory: bool = typer.Option(False, "--memory", help="in-memory store: faster, not durable"),
    capacity: Optional[int] = typer.Option(None, min=1, help="max queued + leased groups (429 beyond) (default 4096)"),
    max_staleness: Optional[int] = typer.Option(None, min=0, help="policy versions a group may lag before eviction (default 1)"),
    token: Optional[str] = typer.Option(None, envvar="HEADRACE_BUFFER_TOKEN", help="bearer token for data endpoints"),
    max_body_mb: Optional[float] = typer.Option(None, min=0.001, help="largest request body in MiB (413 beyond) (default 64)"),
    log_level: str = typer.Option("warning", help="uvicorn log level"),
) -> None:
    """Serve the buffer HTTP API."""
    from headrace.shared.config import ConfigError, load_config

    if db and memory:
        raise typer.BadParameter("give either --db PATH or --memory, not both")
    overrides = {"buffer.host": host, "buffer.port": port, "buffer.db": db, "buffer.memory": memory or None,
                 "buffer.capacity": capacity, "buffer.max_staleness": max_staleness, "buffer.token": token,
                 "buffer.max_body_mb": max_body_mb}
    try:
        cfg = load_config(None, overrides).buffer
    except ConfigError as e:
        typer.echo(f"headrace buffer serve: {e}", err=True)
        raise typer.Exit(2) from None
    from headrace.buffer.app import serve as run_server

    where = "memory (not durable)" if cfg.memory else (cfg.db or "buffer.sqlite")
    typer.echo(f"headrace buffer: http://{cfg.host}:{cfg.port} store={where} capacity={cfg.capacity} "
               f"max_staleness={cfg.max_staleness} auth={'on' if cfg.token else 'off'}", err=True)
    run_server(cfg, log_level=log_level)
