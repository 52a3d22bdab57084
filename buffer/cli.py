"""``headrace buffer serve``: argument parsing only; the service is imported when it runs."""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command("serve")
def serve(
    host: str = typer.Option("127.0.0.1", help="interface to bind"),
    port: int = typer.Option(8100, min=0, max=65535, help="TCP port"),
    db: Optional[str] = typer.Option(None, help="SQLite database file (durable; WAL mode)"),
    memory: bool = typer.Option(False, "--memory", help="in-memory store: faster, not durable"),
    capacity: int = typer.Option(4096, min=1, help="max queued + leased groups (429 beyond)"),
    max_staleness: int = typer.Option(1, min=0, help="policy versions a group may lag before eviction"),
    token: Optional[str] = typer.Option(None, envvar="HEADRACE_BUFFER_TOKEN", help="bearer token for data endpoints"),
    max_body_mb: float = typer.Option(64.0, min=0.001, help="largest request body in MiB (413 beyond)"),
) -> None:
    """Serve the buffer HTTP API."""
    raise typer.Exit("headrace buffer serve: not implemented yet")
