"""``headrace buffer serve``: argument parsing only; the service is imported when it runs.

Precedence: flags > ``HEADRACE_BUFFER__*`` environment variables > ``--config FILE`` (its
``buffer`` section; other sections are validated and ignored) > the defaults of
``shared.config.BufferConfig``; a bad value is one error naming the key. ``headrace run`` and
``headrace launch`` start the buffer with ``--config <out>/config.yaml`` alone, so every
``buffer.*`` key of the run's YAML reaches it.

The token never needs a command line (``ps`` shows command lines to every user): it comes from
``buffer.token`` in the config file, ``HEADRACE_BUFFER__TOKEN``, or ``--token-file``.
Binding a non-loopback address without a token is refused unless ``--insecure``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command("serve")
def serve(
    config: Optional[str] = typer.Option(None, help="run YAML; its buffer section configures the buffer"),
    host: Optional[str] = typer.Option(None, help="interface to bind (default buffer.host, 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, min=0, max=65535, help="TCP port (default buffer.port, 8100)"),
    db: Optional[str] = typer.Option(None, help="SQLite database file (durable; WAL mode) (default ./buffer.sqlite)"),
    memory: bool = typer.Option(False, "--memory", help="in-memory store: faster, not durable"),
    capacity: Optional[int] = typer.Option(None, min=1, help="max queued + leased groups (429 beyond) (default 4096)"),
    max_staleness: Optional[int] = typer.Option(None, min=0, help="policy versions a group may lag before eviction (default 1)"),
    token_file: Optional[Path] = typer.Option(None, help="file holding the bearer token for data endpoints"),
    token: Optional[str] = typer.Option(None, help="bearer token (visible in ps: prefer --token-file, "
                                                   "HEADRACE_BUFFER__TOKEN or buffer.token in --config)"),
    max_body_mb: Optional[float] = typer.Option(None, min=0.001, help="largest request body in MiB (413 beyond) (default 64)"),
    insecure: bool = typer.Option(False, "--insecure", help="allow binding a non-loopback address without a token"),
    log_level: str = typer.Option("warning", help="uvicorn log level"),
) -> None:
    """Serve the buffer HTTP API."""
    from headrace.shared.config import UNSET, ConfigError, load_config

    if db and memory:
        raise typer.BadParameter("give either --db PATH or --memory, not both")
    if token and token_file:
        raise typer.BadParameter("give either --token-file or --token, not both")
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            typer.echo(f"headrace buffer serve: --token-file {token_file}: {e.strerror}", err=True)
            raise typer.Exit(2) from None
        if not token:
            typer.echo(f"headrace buffer serve: --token-file {token_file} is empty", err=True)
            raise typer.Exit(2)
    overrides = {"buffer.host": host, "buffer.port": port, "buffer.capacity": capacity,
                 "buffer.max_staleness": max_staleness, "buffer.token": token, "buffer.max_body_mb": max_body_mb}
    if memory:                    # the flag wins over the file's storage choice
        overrides.update({"buffer.memory": True, "buffer.db": UNSET})
    elif db:
        overrides.update({"buffer.db": db, "buffer.memory": UNSET})
    try:
        cfg = load_config(config, overrides).buffer
    except ConfigError as e:
        typer.echo(f"headrace buffer serve: {e}", err=True)
        raise typer.Exit(2) from None
    if not cfg.token and not insecure and not _loopback(cfg.host):
        typer.echo(f"headrace buffer serve: binding {cfg.host} without buffer.token lets any host read and "
                   "write the buffer; set HEADRACE_BUFFER__TOKEN (or --token-file) or pass --insecure", err=True)
        raise typer.Exit(2)
    from headrace.buffer.app import serve as run_server

    where = "memory (not durable)" if cfg.memory else (cfg.db or "buffer.sqlite")
    typer.echo(f"headrace buffer: http://{cfg.host}:{cfg.port} store={where} capacity={cfg.capacity} "
               f"max_staleness={cfg.max_staleness} max_body_mb={cfg.max_body_mb:g} "
               f"auth={'on' if cfg.token else 'off'}", err=True)
    run_server(cfg, log_level=log_level)
