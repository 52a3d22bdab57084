"""``headrace run``: every service on one machine, as child processes, one Ctrl-C stops all.

The run reads as the loop it supervises: resolve config -> prepare the model -> start buffer,
rollout (which starts the engines) and trainer -> follow metrics.jsonl with a progress bar ->
stop everything -> plot. The trainer drives the RL loop itself; this module only supervises.

Guarantees: the resolved config is written to ``<out>/config.yaml`` before any child starts; a
bad config fails before any process starts; every child is stopped (by pid) on exit, error or
Ctrl-C; ``--resume DIR`` reuses DIR's config, buffer database, data cursor and checkpoints.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from deploy.plot import plot_metrics, read_metrics
from deploy.supervisor import ChildFailed, Supervisor, free_port, headrace_argv, port_free
from shared.config import HeadraceConfig, load_config, save_config


def resolve(config_path: str | None, out: str | None, resume: str | None) -> tuple[HeadraceConfig, bool]:
    """The run's config (the built-in demo when no file is given) and whether it is the demo."""
    if resume:
        saved = Path(resume) / "config.yaml"
        if not saved.is_file():
            raise FileNotFoundError(f"--resume {resume}: no config.yaml there (not a headrace run directory)")
        return load_config(saved), False
    if config_path is None:
        import tempfile

        import yaml

        from deploy.demo import demo_config_dict

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(demo_config_dict(), f)
        cfg = load_config(f.name, overrides={"run.out": out})
        Path(f.name).unlink()
        return cfg, True
    return load_config(config_path, overrides={"run.out": out}), False


def _absolute(cfg: HeadraceConfig) -> HeadraceConfig:
    """Make every path absolute so children can run from any directory."""
    out = Path(cfg.run.out).resolve()
    d = cfg.model_copy(deep=True)
    d.run.out = str(out)
    d.buffer.db = str(Path(d.buffer.db).resolve()) if d.buffer.db else str(out / "buffer.sqlite")
    d.trainer.checkpoint_dir = str(Path(d.trainer.checkpoint_dir).resolve()) if d.trainer.checkpoint_dir else str(out / "ckpt")
    d.rollout.state_path = str(Path(d.rollout.state_path).resolve()) if d.rollout.state_path else str(out / "rollout_state.json")
    if Path(d.model).exists():
        d.model = str(Path(d.model).resolve())
    if d.rollout.data.path:
        d.rollout.data.path = str(Path(d.rollout.data.path).resolve())
    return d


def _pick_ports(cfg: HeadraceConfig) -> None:
    """Keep the configured ports when free; otherwise take free ones and rewrite the URLs."""
    for section in (cfg.buffer, cfg.rollout):
        if not port_free(section.host, section.port):
            section.port = free_port(section.host)
        section.url = f"http://{section.host}:{section.port}"
    if cfg.rollout.engines.backend in ("reference", "sglang"):
        base = cfg.rollout.engines.base_port
        if not all(port_free("127.0.0.1", base + i) for i in range(cfg.rollout.engines.count)):
            cfg.rollout.engines.base_port = free_port()  # the fleet probes upward from here


def prepare_model(cfg: HeadraceConfig, demo: bool) -> None:
    """Make sure cfg.model exists; the demo builds its model and warm-starts it (both cached)."""
    if demo:
        from deploy.demo import prepare_demo_model

        cfg.model = str(prepare_demo_model(Path(cfg.model).parent).resolve())
        return
    if not Path(cfg.model).joinpath("config.json").is_file():
        raise FileNotFoundError(f"model: {cfg.model} is not a Hugging Face model directory "
                                "(make one with `headrace init-model --preset tiny-qwen2 --out DIR`)")


class _Progress:
    """A rich progress bar fed from metrics.jsonl; plain lines when stdout is not a terminal."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console()
        self.tty = self.console.is_terminal
        self.progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), console=self.console, disable=not self.tty)
        self.task = self.progress.add_task("train", total=total, info="starting")
        self.seen = 0
        self.last_eval: float | None = None

    def __enter__(self) -> "_Progress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, rows: list[dict[str, Any]]) -> None:
        for r in rows[self.seen:]:
            if r.get("eval_score") is not None:
                self.last_eval = r["eval_score"]
            info = " ".join(filter(None, [
                _fmt("reward", r.get("reward_mean")), _fmt("eval", self.last_eval),
                _fmt("samples/s", r.get("samples_per_s"), ".1f"), _fmt("staleness", r.get("staleness"), ".0f"),
                _fmt("loss", r.get("loss"), ".4f")]))
            self.progress.update(self.task, completed=r.get("step", 0), info=info)
            if not self.tty:
                print(f"step {r.get('step')}: {info}", flush=True)
        self.seen = len(rows)


def _fmt(name: str, v: Any, spec: str = ".3f") -> str:
    return f"{name} {v:{spec}}" if isinstance(v, (int, float)) else ""


def run_local(config_path: str | None = None, out: str | None = None, resume: str | None = None) -> int:
    """Run everything on this machine; returns the process exit code."""
    cfg, demo = resolve(config_path, out, resume)
    cfg = _absolute(cfg)
    out_dir = Path(cfg.run.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prepare_model(cfg, demo)
    if cfg.run.placement == "colocated":
        cfg.rollout.mode = "on_demand"
    cfg.trainer.export_hf = True
    _pick_ports(cfg)
    config_file = save_config(cfg, out_dir / "config.yaml")
    metrics_path = out_dir / "metrics.jsonl"
    print(f"headrace run: out={out_dir} placement={cfg.run.placement} model={cfg.model}", flush=True)
    start = time.monotonic()
    code = 0
    with Supervisor(out_dir / "logs") as sup:
        try:
            buffer = sup.start("buffer", headrace_argv(
                "buffer", "serve", "--host", cfg.buffer.host, "--port", str(cfg.buffer.port), "--db", str(cfg.buffer.db),
                "--capacity", str(cfg.buffer.capacity), "--max-staleness", str(cfg.buffer.max_staleness)))
            sup.wait_healthy(buffer, f"{cfg.buffer.url}/health", 60)
            rollout = sup.start("rollout", headrace_argv("rollout", "serve", "--config", str(config_file)))
            sup.wait_healthy(rollout, f"{cfg.rollout.url}/health", cfg.rollout.engines.startup_timeout_s + 60)
            trainer = sup.start("trainer", headrace_argv("train", "--config", str(config_file),
                                                         "--rollout-url", cfg.rollout.url),
                                threads=cfg.trainer.threads or 1)
            with _Progress(cfg.trainer.steps) as bar:
                while trainer.alive():
                    sup.check()
                    bar.update(read_metrics(metrics_path))
                    time.sleep(0.5)
                bar.update(read_metrics(metrics_path))
            if trainer.popen.returncode != 0:
                raise ChildFailed(f"trainer exited with code {trainer.popen.returncode} (log {trainer.log_path}):\n{trainer.tail()}")
        except KeyboardInterrupt:
            print("\nheadrace run: interrupted; stopping every service", file=sys.stderr, flush=True)
            code = 130
        except ChildFailed as e:
            print(f"headrace run: {e}", file=sys.stderr, flush=True)
            code = 1
    rows = read_metrics(metrics_path)
    if rows:
        png = plot_metrics(metrics_path, out_dir / "metrics.png", title=f"headrace run ({cfg.run.placement})")
        evals = [r["eval_score"] for r in rows if r.get("eval_score") is not None]
        summary = f"{len(rows)} steps in {time.monotonic() - start:.0f}s"
        if evals:
            summary += f"; eval score {evals[0]:.2f} -> {evals[-1]:.2f}"
        print(f"headrace run: {summary}; metrics {metrics_path}, plot {png}", flush=True)
    return code
