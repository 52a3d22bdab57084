"""Run configuration: precedence (flags > HEADRACE_* env > file > defaults), one clear error per bad
key or contradiction, the resolved config written back (mode 0600), every key documented with a
range, docs/config.md current, and every YAML shipped in the repo parses."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import annotated_types
import pytest
from pydantic import BaseModel

from headrace.shared.config import (UNSET, ConfigError, HeadraceConfig, check_full_run, env_overrides,
                                    load_config, save_config)
from headrace.shared.config_reference import config_reference
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
    env = {"HEADRACE_BUFFER__CAPACITY": "34", "HEADRACE_TOKEN": "t", "HEADRACE_LOG_LEVEL": "debug"}
    cfg = load_config(path, environ=env)
    assert (cfg.buffer.capacity, cfg.buffer.port, cfg.auth.token) == (34, 9001, "t")
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


def test_save_config_is_private(tmp_path: Path) -> None:
    p = tmp_path / "config.yaml"
    p.write_text("old")
    p.chmod(0o644)
    save_config(load_config(overrides={"auth.token": "s3cret"}, environ={}), p)
    assert p.stat().st_mode & 0o777 == 0o600       # private, though the token itself is never written
    assert "s3cret" not in p.read_text() and load_config(p, environ={"HEADRACE_TOKEN": "s3cret"}).auth.token == "s3cret"


@pytest.mark.parametrize("text, keys", [
    ("rollout: {engines: {backend: external}}\n", ["rollout.engines.backend", "rollout.engines.urls"]),
    ("rollout: {reward: remote}\n", ["rollout.reward", "rollout.reward_url"]),
    ("buffer: {memory: true, db: b.sqlite}\n", ["buffer.memory", "buffer.db"]),
    ("rollout: {data: {path: p.jsonl, task: chain_sum}}\n", ["rollout.data.path", "rollout.data.task"]),
    ("trainer: {lr: 1.0e-5, min_lr: 1.0e-4}\n", ["trainer.min_lr", "trainer.lr"]),
    ("trainer: {betas: [0.9, 1.5]}\n", ["trainer.betas"]),
])
def test_contradicting_keys_fail_at_load_naming_them(tmp_path: Path, text: str, keys: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), environ={})
    msg = str(e.value)
    assert all(k in msg for k in keys), msg
    assert "Value error" not in msg and "got {" not in msg    # one plain sentence, not pydantic's dump


def test_both_problems_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "rollout: {reward: remote, engines: {backend: external}}\n"), environ={})
    assert "rollout.reward_url" in str(e.value) and "rollout.engines.urls" in str(e.value)


@pytest.mark.parametrize("text, says", [
    ("run: {engine_tp: 2}\n", "run.engine_tp: moved: set rollout.engines.tp"),
    ("run: {warmup_sft_steps: 3}\n", "run.warmup_sft_steps: removed"),
    ("run: {time_limit_s: 60}\n", "run.time_limit_s: removed"),
])
def test_retired_keys_say_what_to_do(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(write(tmp_path, text), environ={})


def test_unset_override_restores_the_default(tmp_path: Path) -> None:
    path = write(tmp_path, "buffer: {db: b.sqlite}\n")
    cfg = load_config(path, {"buffer.memory": True, "buffer.db": UNSET}, environ={})
    assert cfg.buffer.memory and cfg.buffer.db is None


def test_full_run_checks_name_the_keys() -> None:
    check_full_run(HeadraceConfig())
    with pytest.raises(ConfigError, match=r"buffer.capacity \(8\).*rollout.groups_per_step \(16\)"):
        check_full_run(HeadraceConfig.model_validate({"buffer": {"capacity": 8}}))
    no_eval = {"rollout": {"data": {"path": "p.jsonl"}}}
    with pytest.raises(ConfigError, match="run.eval_every.*rollout.data.eval_path"):
        check_full_run(HeadraceConfig.model_validate(no_eval))
    check_full_run(HeadraceConfig.model_validate({**no_eval, "run": {"eval_every": 0}}))


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field, model


def test_every_key_is_documented_with_readers_and_numbers_have_bounds() -> None:
    for key, field, section in _fields(HeadraceConfig):
        assert field.description and len(field.description) > 10, f"{key}: no description"
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        assert extra.get("read_by") or section.read_by, f"{key}: nobody named as its reader"
        ann = field.annotation
        scalars = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
        if any(t in (int, float) for t in scalars):      # a number, or a number or null
            assert any(isinstance(m, (annotated_types.Ge, annotated_types.Gt)) for m in field.metadata), \
                f"{key}: no lower bound"
    ms = HeadraceConfig.model_fields["buffer"].annotation.model_fields["max_staleness"].description
    assert "admission cap" in ms and "lease floor" in ms


def test_docs_config_md_is_the_reference() -> None:
    doc = REPO / "docs" / "config.md"
    assert doc.is_file() and doc.read_text() == config_reference(), (
        "docs/config.md differs from the config reference; regenerate it with "
        "`headrace config --reference > docs/config.md` (from the repository root)")
    for key, _, _ in _fields(HeadraceConfig):
        assert f"`{key}`" in doc.read_text(), key
