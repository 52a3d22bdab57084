"""The command line: `headrace --help` answers without importing torch; `headrace buffer serve`
parses its flags (DESIGN.md "Command line") and refuses bad ones with a clear message; `headrace
config --reference` prints docs/config.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.procs import REPO, child_env, headrace_cmd

HEAVY = ("torch", "transformers", "megatron", "sglang")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=REPO, env=env or child_env(), capture_output=True, text=True, timeout=120)


def imported_modules(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("args", [["--help"], ["buffer", "serve", "--help"], ["train", "--help"],
                                  ["rollout", "serve", "--help"], ["run", "--help"],
                                  ["config", "--reference"]])
def test_help_does_not_import_heavy_modules(args: list[str]) -> None:
    p = run(sys.executable, "-X", "importtime", "-m", "headrace.deploy.cli", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Usage" in p.stdout or "# Configuration reference" in p.stdout
    mods = imported_modules(p.stderr)
    assert "typer" in mods  # the import log was read
    heavy = sorted(m for m in mods if m.split(".")[0] in HEAVY)
    assert not heavy, f"`headrace {' '.join(args)}` imported {heavy[:10]}"


def test_buffer_serve_help_lists_the_design_flags() -> None:
    p = run(*headrace_cmd("buffer", "serve", "--help"), env=child_env(COLUMNS="200"))
    for flag in ("--config", "--host", "--port", "--db", "--memory", "--capacity", "--max-staleness", "--token-file",
                 "--max-body-mb", "--insecure"):
        assert flag in p.stdout, flag


def test_buffer_serve_refuses_bad_flags_and_config() -> None:
    p = run(*headrace_cmd("buffer", "serve", "--db", "x.sqlite", "--memory"))
    assert p.returncode != 0 and "either --db PATH or --memory" in p.stderr
    p = run(*headrace_cmd("buffer", "serve", "--capacity", "0"))
    assert p.returncode != 0 and "capacity" in p.stderr
    p = run(*headrace_cmd("buffer", "serve", "--memory"), env=child_env(HEADRACE_BUFFER__MAX_STALENESS="-4"))
    assert p.returncode == 2 and "buffer.max_staleness" in p.stderr
    p = run(*headrace_cmd("buffer", "serve", "--host", "0.0.0.0", "--memory"))
    assert p.returncode == 2 and "binding 0.0.0.0 without auth.token" in p.stderr and "--insecure" in p.stderr
    p = run(*headrace_cmd("buffer", "serve", "--token-file", "/nonexistent/token", "--memory"))
    assert p.returncode == 2 and "--token-file /nonexistent/token" in p.stderr


def test_buffer_serve_config_errors_name_the_key(tmp_path) -> None:
    conf = tmp_path / "run.yaml"
    conf.write_text("buffer: {capacity: 0}\n")
    p = run(*headrace_cmd("buffer", "serve", "--config", str(conf)))
    assert p.returncode == 2 and "buffer.capacity" in p.stderr and str(conf) in p.stderr


def test_config_reference_is_docs_config_md() -> None:
    p = run(*headrace_cmd("config", "--reference"))
    assert p.returncode == 0, p.stderr
    assert p.stdout == (REPO / "docs" / "config.md").read_text(), \
        "docs/config.md is stale: run `headrace config --reference > docs/config.md`"


def test_config_check_resolves_a_file_and_hides_the_token(tmp_path) -> None:
    conf = tmp_path / "run.yaml"
    conf.write_text("auth: {token: s3cret}\nbuffer: {capacity: 12}\n")
    p = run(*headrace_cmd("config", "--check", str(conf)))
    assert p.returncode == 0, p.stderr
    assert "capacity: 12" in p.stdout and "s3cret" not in p.stdout
    conf.write_text("rollout: {engines: {backend: external}}\n")
    p = run(*headrace_cmd("config", "--check", str(conf)))
    assert p.returncode == 2 and "rollout.engines.urls" in p.stderr
    assert run(*headrace_cmd("config")).returncode == 2


def test_rollout_serve_starts_its_engine_before_the_data_and_ends_it_when_the_data_is_bad(tmp_path) -> None:
    """`headrace rollout serve` launches its engines before loading data and tokenizer (they load
    their model meanwhile); bad data still exits 2 naming the problem, and ends the engine it started."""
    import re
    from pathlib import Path

    import yaml

    from headrace.shared.modelzoo import init_model
    from tests.procs import free_port

    model = init_model("micro-qwen2", tmp_path / "model")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": str(model), "run": {"out": str(tmp_path / "run")},
        "rollout": {"engines": {"backend": "reference", "count": 1, "base_port": free_port()},
                    "data": {"path": str(tmp_path / "missing.jsonl")}}}))
    p = run(*headrace_cmd("rollout", "serve", "--config", str(cfg), "--port", str(free_port())))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "missing.jsonl" in p.stderr and "does not exist" in p.stderr
    launched = re.search(r"engine 0: pid (\d+)", p.stderr)
    assert launched, p.stderr[-2000:]                    # the engine was started first ...
    pid = int(launched.group(1))
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"   # ... and ended
    assert (tmp_path / "run" / "logs" / "engine-0.log").exists()
