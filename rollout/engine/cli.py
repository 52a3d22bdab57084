"""``headrace engine serve``: argument parsing only; torch is imported when it runs."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command("serve")
def serve(
    model: str = typer.Option(..., help="HF model directory"),
    host: str = typer.Option("127.0.0.1", help="interface to bind"),
    port: int = typer.Option(30000, min=0, max=65535, help="TCP port"),
) -> None:
    """Serve the reference engine (SGLang 0.5.23 HTTP API subset)."""
    raise typer.Exit("headrace engine serve: not implemented yet")
