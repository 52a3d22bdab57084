"""Run configuration: precedence (flags > HEADRACE_* env > file > defaults), one clear error per bad
key, the resolved config written back, and every YAML shipped in the repo parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from headrace.shared.config import ConfigError, HeadraceConfig, env_overrides, load_config, save_config
from tests.procs import REPO


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_and_file(tmp_path: Path) -> None:
    assert load_config(environ={}).buffer.capacity == 4096
    cfg = load_config(write(tmp_path, "buffer: {capacity: 12, max_staleness: 3}\nrollout: {sampling: {temperature: 0.5}}\n"), environ={})
    assert (cfg.buffer.capacity, cfg.buffer.max_staleness, cfg.rollout.sampling.temperature) == (12, 3, 0.5)


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "buffer: {capacity: 12, port: 9001}\n")
    env = {"HEADRACE_BUFFER__CAPACITY": "34", "HEADRACE_BUFFER__TOKEN": "t", "HEADRACE_LOG_LEVEL": "debug"}
    cfg = load_config(path, environ=env)
    assert (cfg.buffer.capacity, cfg.buffer.port, cfg.buffer.token) == (34, 9001, "t")
    cfg = load_config(path, {"buffer.capacity": 56, "buffer.port": None}, environ=env)
    assert (cfg.buffer.capacity, cfg.buffer.port) == (56, 9001)  # None flags do not override
    assert env_overrides({"HEADRACE_ROLLOUT__SAMPLING__TOP_P": "0.9"}) == {"rollout.sampling.top_p": 0.9}


@pytest.mark.parametrize("text, key", [
    ("buffer: {capacityy: 3}\n", "buffer.capacityy: unknown key"),
    ("buffer: {capacity: 0}\n", "buffer.capacity"),
    ("buffer: {max_body_mb: -1}\n", "buffer.max_body_mb"),
    ("rollout: {engines: {backend: warp}}\n", "rollout.engines.backend"),
    ("nonsense: 1\n", "nonsense: unknown key"),
])
def test_bad_key_is_one_clear_error(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), environ={})
    assert key in str(e.value) and str(tmp_path / "run.yaml") in str(e.value)


def test_bad_env_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="buffer.port"):
        load_config(environ={"HEADRACE_BUFFER__PORT": "not-a-port"})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml", environ={})
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"), environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "buffer: {capacity: [\n"), environ={})


def test_save_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(overrides={"buffer.capacity": 77, "trainer.tp": 2}, environ={})
    p = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(p, environ={}) == cfg


def test_every_shipped_yaml_parses() -> None:
    files = sorted(p for d in ("examples", "deploy") for p in (REPO / d).rglob("*.yaml")
                   if "compose" not in p.name)
    assert files, "no shipped configs found"
    for p in files:
        assert isinstance(load_config(p, environ={}), HeadraceConfig), p
