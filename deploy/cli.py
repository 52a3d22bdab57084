"""The ``headrace`` command line: a thin root that mounts each service's own commands.

Guarantee: ``headrace --help`` (and every ``--help``) imports neither torch nor any heavy module;
each command imports its implementation only when it runs.
"""

from __future__ import annotations

import sys

import typer

from headrace.buffer.cli import app as buffer_app
from headrace.deploy.commands import config, init_model, launch, run
from headrace.rollout.cli import app as rollout_app
from headrace.rollout.engine.cli import app as engine_app
from headrace.trainer.cli import model_app, train

app = typer.Typer(
    name="headrace",
    help="Headrace: decoupled RL post-training (rollout, buffer, trainer services).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(buffer_app, name="buffer", help="The durable sample buffer service.")
app.add_typer(engine_app, name="engine", help="The reference CPU inference engine (SGLang API subset).")
app.add_typer(rollout_app, name="rollout", help="The rollout service (data, engines, rewards).")
app.command("train", help="Run the trainer (leases from the buffer, trains, syncs weights).")(train)
app.add_typer(model_app, name="model", help="Model tools (parity log-probabilities).")
app.command("run", help="Everything on one machine (the CPU demo with no config).")(run)
app.command("launch", help="Launch on a Ray cluster (colocated or disaggregated).")(launch)
app.command("init-model", help="Write a small random HF model + tokenizer, offline.")(init_model)
app.command("config", help="Every config key documented (--reference), or a run YAML checked (--check FILE).")(config)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="headrace")


if __name__ == "__main__":
    sys.exit(main())
