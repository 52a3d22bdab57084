"""``headrace rollout serve``: argument parsing only; the service is imported when it runs."""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command("serve")
def serve(
    config: str = typer.Option(..., help="run YAML (section rollout)"),
    host: Optional[str] = typer.Option(None, help="interface to bind (default rollout.host)"),
    port: Optional[int] = typer.Option(None, min=0, max=65535, help="TCP port (default rollout.port, 8200)"),
    buffer_url: Optional[str] = typer.Option(None, help="buffer URL (default buffer.url)"),
) -> None:
    """Serve the rollout service."""
    raise typer.Exit("headrace rollout serve: not implemented yet")
