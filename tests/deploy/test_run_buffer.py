"""``headrace run`` and the Ray launcher start the buffer from the run's config file
(``headrace buffer serve --config``), so every ``buffer.*`` key of the YAML reaches it. Each test
starts the buffer exactly as ``headrace run`` does (``deploy.local.buffer_argv`` on the config file
``save_config`` wrote, the token in its environment as ``headrace run`` gives it) as a real process,
and checks the running buffer honours the key."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from headrace.deploy.local import buffer_argv
from headrace.shared.auth import token_env
from headrace.shared.config import load_config, save_config
from tests.procs import Proc, child_env, free_port

TOKEN = "tok-3f9a"


def start(tmp_path: Path, buffer: dict, token: str | None = None) -> tuple[Proc, str, Path]:
    """Write a run config with ``buffer`` keys the way headrace run does and start its buffer."""
    port = free_port()
    cfg = load_config(overrides={"run.out": str(tmp_path / "out"), "buffer.port": port, "auth.token": token,
                                 **{f"buffer.{k}": v for k, v in buffer.items()}}, environ={})
    config_file = save_config(cfg, tmp_path / "out" / "config.yaml")
    argv = buffer_argv(config_file)
    assert TOKEN not in " ".join(argv)                     # never on a command line (ps shows it)
    assert TOKEN not in config_file.read_text()            # nor in a file we write
    proc = Proc(argv, tmp_path / "buffer.log", env=child_env(**token_env(token)), cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", 60)
    except BaseException:
        proc.stop()
        raise
    return proc, url, config_file


def test_the_run_token_protects_the_buffer(tmp_path: Path) -> None:
    proc, url, config_file = start(tmp_path, {"memory": True}, token=TOKEN)
    try:
        assert config_file.stat().st_mode & 0o777 == 0o600
        assert TOKEN.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert httpx.get(url + "/v1/stats").status_code == 401
        assert httpx.get(url + "/v1/stats", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/v1/stats", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    finally:
        proc.stop()


def test_memory_from_the_yaml_writes_no_database(tmp_path: Path) -> None:
    proc, url, _ = start(tmp_path, {"memory": True})
    try:
        assert httpx.get(url + "/v1/stats").status_code == 200     # no token set: open
    finally:
        proc.stop()
    assert not list(tmp_path.rglob("*.sqlite*")), list(tmp_path.rglob("*.sqlite*"))
    assert "store=memory" in proc.log_path.read_text()


def test_durable_default_writes_the_database_of_the_yaml(tmp_path: Path) -> None:
    db = tmp_path / "out" / "b.sqlite"
    proc, url, _ = start(tmp_path, {"db": str(db)})
    proc.stop()
    assert db.is_file()


def test_max_body_mb_from_the_yaml_bounds_requests(tmp_path: Path) -> None:
    proc, url, _ = start(tmp_path, {"max_body_mb": 0.01, "memory": True})
    try:
        r = httpx.post(url + "/v1/groups", content=b"[" + b" " * 20_000 + b"]",
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        small = httpx.post(url + "/v1/groups", content=b"[]", headers={"content-type": "application/json"})
        assert small.status_code != 413
    finally:
        proc.stop()


@pytest.mark.parametrize("flag, value, key", [("--capacity", "7", "capacity=7"), ("--max-body-mb", "2", "max_body_mb=2")])
def test_flags_override_the_file(tmp_path: Path, flag: str, value: str, key: str) -> None:
    port = free_port()
    cfg = load_config(overrides={"buffer.port": port, "buffer.memory": True, "buffer.capacity": 99,
                                 "buffer.max_body_mb": 9}, environ={})
    config_file = save_config(cfg, tmp_path / "config.yaml")
    proc = Proc(buffer_argv(config_file) + [flag, value], tmp_path / "buffer.log", cwd=tmp_path)
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", 60)
    finally:
        proc.stop()
    assert key in proc.log_path.read_text()


def test_headrace_run_keeps_an_in_memory_buffer_in_memory(tmp_path: Path) -> None:
    from headrace.deploy.local import _absolute

    cfg = load_config(overrides={"run.out": str(tmp_path), "buffer.memory": True}, environ={})
    assert _absolute(cfg).buffer.db is None                 # no database path added next to memory: true
    assert _absolute(load_config(overrides={"run.out": str(tmp_path)}, environ={})).buffer.db == str(
        tmp_path.resolve() / "buffer.sqlite")
