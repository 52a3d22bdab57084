"""Run configuration: one pydantic model per service, combined into one run config.

Precedence, highest first: command-line flags > ``HEADRACE_*`` environment variables > the YAML
file > defaults. Environment variables address keys with ``__`` between levels, e.g.
``HEADRACE_BUFFER__CAPACITY=512`` or ``HEADRACE_ROLLOUT__SAMPLING__TEMPERATURE=0.7``; values are
parsed as YAML scalars. Every key has a description (what it does, its unit, which services read
it) and a range; an unknown or out-of-range key, or keys that contradict each other, raise one
``ConfigError`` that names them (``buffer.capacity: ...``) before any process starts.

``shared.config_reference`` renders every key as Markdown (``headrace config --reference``, which
is docs/config.md). Who reads a key is the section's ``read_by`` unless the field names its own
(``json_schema_extra={"read_by": ...}``).

The section models live in ``shared.config_sections``; this module combines them, checks the
rules between keys and loads YAML + environment + flags. It imports neither torch nor any service.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

import yaml
from pydantic import Field, ValidationError, model_validator

# The sections are part of this module's API (re-exported for ``from headrace.shared.config import TrainerConfig``).
from headrace.shared.auth import REDACTED, TOKEN_ENV, read_token_file
from headrace.shared.config_sections import (AuthConfig, BufferConfig, DataConfig, EnginesConfig,  # noqa: F401
                                             LoRAConfig, NumGpus, RolloutConfig, RunSection, SamplingConfig, ShardConfig,
                                             TrainerConfig, _Section)

ENV_PREFIX = "HEADRACE_"


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


class HeadraceConfig(_Section):
    """One run: a section per service plus ``run``; ``model`` is shared by rollout and trainer."""

    read_by: ClassVar[str] = "rollout, trainer"
    model: str = Field(default="models/tiny-qwen2", min_length=1,
                       description="HF model directory (config, safetensors, tokenizer); engines load it too")
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunSection = Field(default_factory=RunSection)
    auth: AuthConfig = Field(default_factory=AuthConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "HeadraceConfig":
        """Keys that contradict each other: one error naming every key involved."""
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def resolved_path(self, value: str | None, default_name: str) -> Path:
        """A path from the config, or ``<run.out>/<default_name>`` when unset."""
        return Path(value) if value else Path(self.run.out) / default_name


def cross_field_problems(cfg: HeadraceConfig) -> list[str]:
    """Contradictions between keys that every command refuses (each message names its keys)."""
    b, r, t = cfg.buffer, cfg.rollout, cfg.trainer
    out = []
    if b.memory and b.db:
        out.append(f"buffer.memory is true and buffer.db is {b.db!r}: an in-memory buffer writes no file; "
                   "drop one of the two")
    if r.engines.backend == "external" and not r.engines.urls:
        out.append("rollout.engines.backend is external but rollout.engines.urls is empty: "
                   "list the URLs of the engines started elsewhere")
    if r.reward == "remote" and not r.reward_url:
        out.append("rollout.reward is remote but rollout.reward_url is not set: give the reward server's URL")
    if r.data.path and r.data.task:
        out.append(f"rollout.data.path ({r.data.path!r}) and rollout.data.task ({r.data.task!r}) are both set: "
                   "the prompts come from one of them")
    if cfg.run.rollout_services > 1 and r.data.shard is not None:
        out.append(f"run.rollout_services is {cfg.run.rollout_services} and rollout.data.shard is set: the run gives "
                   "each of its rollout services its shard itself; drop rollout.data.shard")
    if cfg.run.rollout_services > 1 and r.router == "sglang" and r.engines.router_port is not None:
        out.append(f"run.rollout_services is {cfg.run.rollout_services} and rollout.engines.router_port is "
                   f"{r.engines.router_port}: each service starts its own sglang-router, so they cannot share one port; "
                   "drop rollout.engines.router_port (each then takes a free port)")
    if t.min_lr > t.lr:
        out.append(f"trainer.min_lr ({t.min_lr}) exceeds trainer.lr ({t.lr})")
    if not all(0.0 <= beta < 1.0 for beta in t.betas):
        out.append(f"trainer.betas {list(t.betas)}: each must be in [0, 1)")
    if t.lora_sync == "adapter" and t.lora is None:
        out.append("trainer.lora_sync is adapter but trainer.lora is null: an adapter sync needs LoRA training: "
                   "set trainer.lora or trainer.lora_sync: merged")
    if t.lora is not None and t.lora_sync == "adapter" and t.weight_sync_hook:
        out.append("trainer.lora_sync is adapter and trainer.weight_sync_hook is set: the plugin does the weight "
                   "sync, so the adapter path would never run: drop one of the two")
    return out


def check_full_run(cfg: HeadraceConfig) -> None:
    """Extra checks for a run that starts every service (``headrace run``, ``headrace launch``).

    These depend on the services running together, so a service started alone (``headrace buffer
    serve --capacity 3``) does not apply them. Raises one ``ConfigError`` naming the keys.
    """
    r = cfg.rollout
    problems = []
    if cfg.buffer.capacity < r.groups_per_step:
        problems.append(f"buffer.capacity ({cfg.buffer.capacity}) is below rollout.groups_per_step "
                        f"({r.groups_per_step}): the trainer could never lease a full step")
    if cfg.run.eval_every and r.data.path and not r.data.eval_path:
        problems.append(f"run.eval_every is {cfg.run.eval_every} but prompts come from rollout.data.path with no "
                        "rollout.data.eval_path: the first evaluation (step 0) would fail; set "
                        "rollout.data.eval_path or run.eval_every: 0")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


# ---- loading ---------------------------------------------------------------------------------

# keys that existed once: the error says what to do instead of only "unknown key"
_RETIRED = {
    "run.engine_tp": "moved: set rollout.engines.tp",
    "run.warmup_sft_steps": "removed: nothing read it (the demo's warm-up is built in)",
    "run.time_limit_s": "removed: nothing read it (stop a run with Ctrl-C or trainer.steps)",
    "buffer.token": "moved: the run's one token is auth.token, set with the HEADRACE_TOKEN environment "
                    "variable or auth.token_file (--token-file), never in a file Headrace writes",
}

UNSET = object()
"""An ``overrides`` value that removes the key (back to its default), e.g. ``--memory`` drops a file's db."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    if value is UNSET:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``HEADRACE_A__B=v`` -> ``{"a.b": yaml(v)}`` for keys under a config section (or MODEL).

    Other ``HEADRACE_*`` variables (e.g. ``HEADRACE_LOG_LEVEL``) are not config keys and are ignored.
    """
    environ = os.environ if environ is None else environ
    sections = set(HeadraceConfig.model_fields)
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower().replace("__", ".")
        if key.split(".")[0] not in sections or (key != "model" and "." not in key):
            continue
        try:
            out[key] = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"{name}: not a valid value ({e})") from None
    return out


def _format_error(e: ValidationError, origin: str) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: " + (_RETIRED[key] if key in _RETIRED else "unknown key"))
        elif not key:          # a cross-field problem: its message names the keys
            lines.extend(msg.removeprefix("Value error, ").split("; "))
        else:
            lines.append(f"{key}: {msg} (got {err.get('input')!r})")
    return f"invalid configuration ({origin}):\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> HeadraceConfig:
    """Load a run config. ``overrides`` are dotted keys from command-line flags (None values skipped,
    ``UNSET`` removes the key)."""
    tree: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
        origin = str(p)
    env = os.environ if environ is None else environ
    for key, value in env_overrides(env).items():
        _set_dotted(tree, key, value)
    if env.get(TOKEN_ENV):
        _set_dotted(tree, "auth.token", env[TOKEN_ENV])
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
    try:
        cfg = HeadraceConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, origin)) from None
    _resolve_token(cfg.auth)
    return cfg


def _resolve_token(auth: AuthConfig) -> None:
    """``auth.token`` from ``auth.token_file`` when no token was given; a saved config's
    placeholder (``"***"``) with nothing to replace it is an error, not an open service."""
    if auth.token and auth.token != REDACTED:
        return
    if auth.token_file:
        try:
            auth.token = read_token_file(auth.token_file, "auth.token_file")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif auth.token == REDACTED:
        raise ConfigError(f'auth.token is "{REDACTED}", the placeholder a saved config holds in place of the token: '
                          f"give the token with {TOKEN_ENV} or auth.token_file (--token-file)")


def save_config(config: HeadraceConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML (next to a run's outputs), readable by its owner only
    (mode 0600). ``auth.token`` is written as ``"***"``: services started from the file get the
    token through their environment (``HEADRACE_TOKEN``), never from a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)           # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(redacted(config), sort_keys=False))
    return p


def redacted(config: HeadraceConfig) -> dict[str, Any]:
    """The config as a JSON-able dict with ``auth.token`` replaced by ``"***"`` (for files and screens)."""
    d = config.model_dump(mode="json")
    if d["auth"]["token"]:
        d["auth"]["token"] = REDACTED
    return d


def rollout_mode(cfg: HeadraceConfig) -> Literal["continuous", "on_demand"]:
    """The rollout mode a run really uses: colocated placement is always ``on_demand`` (the
    engines must not generate while the trainer holds the devices); otherwise ``rollout.mode``.
    ``headrace run``, the Ray launcher and the trainer all decide it here."""
    return "on_demand" if cfg.run.placement == "colocated" else cfg.rollout.mode

