"""``headrace run``: every service on one machine, as child processes, one Ctrl-C stops all.

The run reads as the loop it supervises: resolve config -> prepare the model -> start buffer,
rollout (which starts the engines) and trainer together (the trainer waits for the other two once
its model is built) -> follow metrics.jsonl with a progress bar -> stop everything -> plot. The
trainer drives the RL loop itself; this module only supervises.

What a run writes to ``<out>`` (``--out``, else ``run.out``): ``config.yaml`` (the resolved config,
absolute paths and the ports actually used), ``metrics.jsonl`` (one JSON object per step: step,
reward_mean, loss, approx_kl (kl_ref with a reference), entropy, weight_version, samples_per_s, staleness, ...; ``eval_score`` on
evaluation steps, and a step-0 row with the baseline evaluation), ``metrics.png``, ``ckpt/``
(trainer checkpoints), ``hf/`` (the final policy as a Hugging Face directory), ``buffer.sqlite`` (and
``buffer.sqlite.blobs/``, its payload segments),
``rollout_state.json`` (the data cursor) and ``logs/<service>.log``.

Several rollout services (``run.rollout_services`` k > 1): the run starts k of them, ``rollout0`` ..
``rollout<k-1>``, each from its own ``<out>/rollout<i>.yaml``: a contiguous block of the engines (of
``rollout.engines.count`` launched ones, their ports counting up from ``base_port`` as one fleet's
would, or of ``rollout.engines.urls``), its shard of the prompts (``rollout.data.shard {i, k}``: its
own cursor, ``rollout_state.shard<i>of<k>.json``) and its port; the trainer gets every URL
(``--rollout-url`` once per service; ``rollout.url`` / ``rollout.extra_urls`` in config.yaml). Fewer
engines than services is a ``ConfigError`` before anything starts.

Placement: ``run.placement: disaggregated`` runs the rollout in continuous mode (generation ahead
of training within ``buffer.max_staleness`` versions); ``colocated`` forces ``rollout.mode:
on_demand`` (generate a batch, release the engines' memory, train, resume memory, sync);
``shared.config.rollout_mode`` decides.

Every service starts from ``<out>/config.yaml`` (mode 0600), the buffer too (``headrace buffer
serve --config``), so every key of the YAML reaches it. The run token (``auth.token``) is written
there as ``"***"``: every child gets it in its environment (``HEADRACE_TOKEN``), never in argv.

Resume: ``headrace run --resume DIR`` reruns the run in DIR from its last checkpoint: the config is
DIR/config.yaml, with ``HEADRACE_*`` environment overrides applied on top (e.g.
``HEADRACE_TRAINER__STEPS=500`` to train further; the merged config is written back to
DIR/config.yaml); ``--config`` and a different ``--out`` are refused. The trainer restores model,
optimizer, schedule, step and policy version from ``ckpt/latest`` and pushes those weights to the
engines before the first lease; the buffer (same database: unconsumed groups stay, acked groups are
never served again) and the rollout's data cursor (same ``rollout_state.json``: no prompt is drawn
twice) carry on. metrics.jsonl rows after the checkpoint's step (an interrupted run trained past its
last checkpoint) are dropped so the step column stays increasing. ``headrace run`` checkpoints
every 10 steps when ``trainer.save_every`` is 0; on Ctrl-C the trainer is stopped first, with
SIGTERM, while the other services still run: it finishes its step, acks it and checkpoints it, so
a Ctrl-C loses no finished step (a trainer killed outright loses at most 10).

Guarantees: the resolved config is written to ``<out>/config.yaml`` before any child starts; a
bad config fails before any process starts (exit 2, the message names the key); every child is
stopped (by pid, its whole process group) on exit, error or Ctrl-C; Ctrl-C exits 130.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from headrace.deploy.plan import PlanError, attached, engine_blocks, rollout_services
from headrace.deploy.plot import plot_metrics, read_metrics
from headrace.deploy.supervisor import ChildFailed, Supervisor, headrace_argv
from headrace.shared.auth import token_env
from headrace.shared.procs import free_port, port_free
from headrace.shared.config import ConfigError, HeadraceConfig, check_full_run, load_config, rollout_mode, save_config


DEFAULT_SAVE_EVERY = 10


def resolve(config_path: str | None, out: str | None, resume: str | None) -> tuple[HeadraceConfig, bool]:
    """The run's config (the built-in demo when no file is given) and whether it is the demo."""
    if resume:
        if config_path is not None:
            raise ConfigError(f"--resume {resume} uses {resume}/config.yaml; drop --config (change keys with "
                              "HEADRACE_* environment variables, e.g. HEADRACE_TRAINER__STEPS=500)")
        saved = Path(resume) / "config.yaml"
        if not saved.is_file():
            raise FileNotFoundError(f"--resume {resume}: no config.yaml there (not a headrace run directory)")
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise ConfigError(f"--out {out} differs from --resume {resume}: a resumed run writes where it ran")
        cfg = load_config(saved)
        if Path(cfg.run.out).resolve() != Path(resume).resolve():
            raise ConfigError(f"--resume {resume}: its config.yaml has run.out: {cfg.run.out} (the run was moved?); "
                              "resume it where it ran")
        return cfg, False
    if config_path is None:
        import tempfile

        import yaml

        from headrace.deploy.demo import demo_config_dict

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
    if not d.buffer.memory:
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
        if not port_free(section.port, section.host):
            section.port = free_port(section.host)
        section.url = f"http://{section.host}:{section.port}"
    if cfg.rollout.engines.backend in ("reference", "sglang"):
        base = cfg.rollout.engines.base_port
        if not all(port_free(base + i) for i in range(cfg.rollout.engines.count)):
            cfg.rollout.engines.base_port = free_port()  # the fleet probes upward from here


def engine_split(cfg: HeadraceConfig) -> list[range]:
    """The engines each rollout service of the run drives (``run.rollout_services`` blocks of the
    launched engines, or of ``rollout.engines.urls`` when the rollout attaches to those);
    ``ConfigError`` when there are fewer engines than services."""
    eng = cfg.rollout.engines
    n, what = (len(eng.urls), "len(rollout.engines.urls)") if attached(cfg) else (eng.count, "rollout.engines.count")
    try:
        return engine_blocks(n, cfg.run.rollout_services, what)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def check_cursor_layout(cfg: HeadraceConfig) -> None:
    """On resume: ``ConfigError`` when the run's data cursors were written by another number of
    rollout services than ``run.rollout_services`` (the shards' prompts would be drawn anew)."""
    path = Path(cfg.rollout.state_path or Path(cfg.run.out) / "rollout_state.json")
    found = {1} if path.exists() else set()
    pattern = re.compile(rf"{re.escape(path.stem)}\.shard\d+of(\d+){re.escape(path.suffix)}")
    if path.parent.is_dir():
        found |= {int(m.group(1)) for f in path.parent.iterdir() if (m := pattern.fullmatch(f.name))}
    k = cfg.run.rollout_services
    if found and k not in found:
        raise ConfigError(f"run.rollout_services is {k} but the run's data cursors in {path.parent} were written by "
                          f"{' or '.join(map(str, sorted(found)))} rollout service(s); resume with that many "
                          f"(HEADRACE_RUN__ROLLOUT_SERVICES={max(found)}), or each shard would draw its prompts anew")


def buffer_argv(config_file: Path) -> list[str]:
    """The buffer's command: every ``buffer.*`` key comes from the run's config file, so none is
    lost; the token comes from the environment, so no secret shows on a command line."""
    return headrace_argv("buffer", "serve", "--config", str(config_file))


def prepare_model(cfg: HeadraceConfig, demo: bool) -> None:
    """Make sure cfg.model exists; the demo builds its model and warm-starts it (both cached)."""
    if demo:
        from headrace.deploy.demo import prepare_demo_model

        cfg.model = str(prepare_demo_model(Path(cfg.model).parent).resolve())
        return
    if not Path(cfg.model).joinpath("config.json").is_file():
        raise FileNotFoundError(f"model: {cfg.model} is not a Hugging Face model directory "
                                "(make one with `headrace init-model --preset tiny-qwen2 --out DIR`)")


def checkpoint_step(ckpt_dir: Path) -> int | None:
    """The step of the newest complete checkpoint in ``ckpt_dir`` (reads only files), or None."""
    marker = ckpt_dir / "latest"
    if not marker.is_file():
        return None
    path = ckpt_dir / marker.read_text().strip()
    try:
        return int(json.loads((path / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def trim_metrics(metrics_path: Path, last_step: int) -> int:
    """Drop metrics rows after ``last_step`` (trained past the checkpoint, redone on resume); returns how many."""
    if not metrics_path.is_file():
        return 0
    lines = metrics_path.read_text().splitlines()
    keep = [ln for ln in lines if _row_step(ln) is not None and _row_step(ln) <= last_step]
    if len(keep) != len(lines):
        metrics_path.write_text("".join(ln + "\n" for ln in keep))
    return len(lines) - len(keep)


def _row_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class _Progress:
    """A rich progress bar fed from metrics.jsonl; plain lines when stdout is not a terminal."""

    def __init__(self, total: int, done: int = 0, seen: list[dict[str, Any]] | None = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console()
        self.tty = self.console.is_terminal
        self.progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), console=self.console, disable=not self.tty)
        self.task = self.progress.add_task("train", total=total, completed=done, info="starting")
        self.seen = len(seen or [])       # rows of an earlier (resumed) run are not shown again
        evals = [r["eval_score"] for r in seen or [] if r.get("eval_score") is not None]
        self.last_eval: float | None = evals[-1] if evals else None

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
    """Run everything on this machine; returns the process exit code (0 done, 1 a service failed, 130 Ctrl-C
    or SIGTERM).

    Raises ``ConfigError`` / ``FileNotFoundError`` for a bad config, a missing model or a bad
    ``--resume`` directory, before any child process starts.
    """
    # SIGTERM (``kill``, a job scheduler, ``timeout``) takes Ctrl-C's path: every child is stopped,
    # the trainer first so it checkpoints; by default Python would die at once and orphan them
    previous = (signal.signal(signal.SIGTERM, _interrupt)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        return _run(config_path, out, resume)
    except KeyboardInterrupt:          # during config resolution or the demo's warm-up: nothing to stop
        print("\nheadrace run: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _fresh_out(path: Path) -> Path:
    """``path`` if it holds no run yet, else the first free ``path-2``, ``path-3``, ..."""
    def holds_run(p: Path) -> bool:
        return (p / "metrics.jsonl").exists() or (p / "ckpt").exists()

    n, candidate = 2, path
    while holds_run(candidate):
        candidate = path.with_name(f"{path.name}-{n}")
        n += 1
    return candidate


def _run(config_path: str | None, out: str | None, resume: str | None) -> int:
    cfg, demo = resolve(config_path, out, resume)
    check_full_run(cfg)
    blocks = engine_split(cfg)
    if not resume and out is None:      # no --out: never refuse, take the next free directory instead
        fresh = _fresh_out(Path(cfg.run.out))
        if fresh != Path(cfg.run.out):
            print(f"headrace run: {cfg.run.out} already holds a run; writing to {fresh}", flush=True)
            cfg.run.out = str(fresh)
    cfg = _absolute(cfg)
    out_dir = Path(cfg.run.out)
    prepare_model(cfg, demo)
    cfg.rollout.mode = rollout_mode(cfg)
    cfg.trainer.export_hf = True
    if not cfg.trainer.save_every:
        cfg.trainer.save_every = DEFAULT_SAVE_EVERY
    metrics_path = out_dir / "metrics.jsonl"
    done = checkpoint_step(Path(cfg.trainer.checkpoint_dir)) or 0
    if resume:
        check_cursor_layout(cfg)
        dropped = trim_metrics(metrics_path, done)
        print(f"headrace run: resuming {out_dir} at step {done} of {cfg.trainer.steps}"
              + (f" ({dropped} metrics rows after the checkpoint dropped)" if dropped else ""), flush=True)
        if done >= cfg.trainer.steps:
            print(f"headrace run: already at trainer.steps={cfg.trainer.steps}; to train further raise it, e.g. "
                  f"HEADRACE_TRAINER__STEPS={cfg.trainer.steps * 2} headrace run --resume {out_dir}", flush=True)
    elif done or metrics_path.exists():
        raise ConfigError(f"{out_dir} already holds a run (checkpoint at step {done}, {metrics_path.name}); "
                          f"continue it with `headrace run --resume {out_dir}` or pass another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    _pick_ports(cfg)
    config_file = save_config(cfg, out_dir / "config.yaml")
    services = rollout_services(cfg, blocks, config_file, lambda: free_port(cfg.rollout.host))
    if len(services) > 1:   # the run's config names the services the trainer drives
        config_file = save_config(cfg, out_dir / "config.yaml")
    print(f"headrace run: out={out_dir} placement={cfg.run.placement} (rollout {cfg.rollout.mode}"
          + (f", {len(services)} rollout services" if len(services) > 1 else "") + f") model={cfg.model}", flush=True)
    if cfg.rollout.mode == "on_demand" and cfg.rollout.engines.backend == "vllm" and not Path("/dev/nvidia0").exists():
        print("headrace run: vLLM engines on CPU: releasing their memory between phases (vLLM's /sleep) frees "
              "nothing here (it is GPU-only); engines and trainer share this machine's RAM", flush=True)
    start = time.monotonic()
    code = 0
    with Supervisor(out_dir / "logs", env=token_env(cfg.auth.token)) as sup:
        try:
            # every service starts at once: the rollout needs the buffer only to push groups
            # (retried while it is down) and the trainer waits for both once its model is built
            # (trainer.loop.wait_for_services), so their starts overlap
            buffer = sup.start("buffer", buffer_argv(config_file))
            rollouts = [(sup.start(name, headrace_argv("rollout", "serve", "--config", str(file))), url)
                        for name, url, file in services]
            trainer = sup.start("trainer", headrace_argv("train", "--config", str(config_file),
                                                         *(a for _, url, _ in services for a in ("--rollout-url", url))),
                                threads=cfg.trainer.threads or 1, stop_first=True)
            sup.wait_healthy(buffer, f"{cfg.buffer.url}/health", 60)
            for rollout, url in rollouts:
                sup.wait_healthy(rollout, f"{url}/health", cfg.rollout.engines.startup_timeout_s + 60)
            with _Progress(cfg.trainer.steps, done, read_metrics(metrics_path)) as bar:
                while trainer.alive():
                    sup.check()
                    bar.update(read_metrics(metrics_path))
                    try:
                        trainer.popen.wait(0.5)   # returns as soon as the trainer is done
                    except subprocess.TimeoutExpired:
                        pass
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
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int) and r.get("loss") is not None]
    if steps:
        png = plot_metrics(metrics_path, out_dir / "metrics.png", title=f"headrace run ({cfg.run.placement})")
        evals = [r["eval_score"] for r in rows if r.get("eval_score") is not None]
        summary = f"at step {steps[-1]} of {cfg.trainer.steps} after {time.monotonic() - start:.0f}s"
        if evals:
            summary += f"; eval score {evals[0]:.3f} -> {evals[-1]:.3f}"
        print(f"headrace run: {summary}; metrics {metrics_path}, plot {png}"
              + (f", policy {cfg.resolved_path(cfg.trainer.export_hf_dir, 'hf')}" if code == 0 else ""), flush=True)
    if code == 130:
        print(f"headrace run: continue with `headrace run --resume {out_dir}`", file=sys.stderr, flush=True)
    return code
