"""``headrace rollout serve``: argument parsing only; the service is imported when it runs.

The run token (``auth.token``: ``HEADRACE_TOKEN``, ``auth.token_file`` or ``--token-file``; ``--token``
is refused) protects the service and reaches the engines it launches through their environment.
Binding the service or launched engines beyond loopback without a token is refused unless ``--insecure``.
"""

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
    max_body_mb: Optional[float] = typer.Option(None, min=0.001, max=1024.0, help="largest control-API request body "
                                                "in MiB, 413 beyond (default rollout.max_body_mb, 1)"),
    token_file: Optional[str] = typer.Option(None, help="file holding the run's bearer token (auth.token; "
                                                        "or set HEADRACE_TOKEN)"),
    token: Optional[str] = typer.Option(None, hidden=True, help="refused: use --token-file"),
    insecure: bool = typer.Option(False, "--insecure", help="allow binding a non-loopback address (the service's "
                                                            "or launched engines') without a token"),
) -> None:
    """Serve the rollout service."""
    import logging
    import os

    from headrace.shared.auth import bind_refusal, flag_token
    from headrace.shared.config import ConfigError, load_config
    from headrace.shared.plugins import PluginError

    logging.basicConfig(level=os.environ.get("HEADRACE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = load_config(config, {"rollout.host": host, "rollout.port": port, "buffer.url": buffer_url,
                                   "rollout.max_body_mb": max_body_mb, "auth.token": flag_token(token, token_file)})
        eng = cfg.rollout.engines
        hosts = [cfg.rollout.host] + ([eng.host] if eng.backend != "external" else [])
        refusal = next(filter(None, (bind_refusal(h, cfg.auth.token, insecure) for h in hosts)), None)
        if refusal:
            raise ValueError(refusal)
        from headrace.rollout.service import create_app

        app = create_app(cfg, launch_engines=True)
    except (ConfigError, PluginError, ValueError, OSError) as e:  # DataError is a ValueError
        typer.echo(f"headrace rollout serve: {e}", err=True)
        raise typer.Exit(2)
    from headrace.shared.serving import BodyLimit
    from headrace.shared.serving import serve as run

    # stops within shared.serving.DEADLINE_S of SIGTERM, whatever it is doing (engines are stopped
    # on the way out, and stop by themselves once this process is gone: --parent-pid)
    limited = BodyLimit(app, int(cfg.rollout.max_body_mb * 1024 * 1024), "rollout.max_body_mb")
    run(limited, cfg.rollout.host, cfg.rollout.port, name="headrace rollout serve")
