"""Run configuration: one pydantic model per service, combined into one run config.

Precedence, highest first: command-line flags > ``HEADRACE_*`` environment variables > the YAML
file > defaults. Environment variables address keys with ``__`` between levels, e.g.
``HEADRACE_BUFFER__CAPACITY=512`` or ``HEADRACE_ROLLOUT__SAMPLING__TEMPERATURE=0.7``; values are
parsed as YAML scalars. Every key has a description and a range; an unknown or out-of-range key
raises one ``ConfigError`` that names it (``buffer.capacity: ...``) before any process starts.

This module imports neither torch nor any service.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "HEADRACE_"


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---- buffer ----------------------------------------------------------------------------------


class BufferConfig(_Section):
    url: str = Field(default="http://127.0.0.1:8100", description="where clients reach the buffer")
    host: str = Field(default="127.0.0.1", description="interface the buffer binds")
    port: int = Field(default=8100, ge=0, le=65535, description="TCP port the buffer binds")
    db: str | None = Field(default=None, description="SQLite file; default <run.out>/buffer.sqlite")
    memory: bool = Field(default=False, description="keep everything in memory (not durable, faster)")
    capacity: int = Field(default=4096, ge=1, le=10_000_000, description="max queued + leased groups")
    max_staleness: int = Field(default=1, ge=0, le=1_000_000, description="policy versions a group may lag")
    token: str | None = Field(default=None, description="bearer token required on data endpoints")
    max_body_mb: float = Field(default=64.0, gt=0, le=4096, description="largest accepted request body")
    lease_s: float = Field(default=600.0, gt=0, description="default lease duration for trainer leases")


# ---- rollout ---------------------------------------------------------------------------------


class EnginesConfig(_Section):
    backend: Literal["reference", "sglang", "external"] = Field(
        default="reference", description="reference CPU engine, SGLang servers, or URLs started elsewhere")
    count: int = Field(default=1, ge=1, le=1024, description="engines to launch (reference / sglang)")
    python: str | None = Field(default=None, description="python of the SGLang venv (backend sglang)")
    args: list[str] = Field(default_factory=list, description="extra server arguments")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of launched engines "
                                "(e.g. SGLANG_USE_CPU_ENGINE: '1')")
    urls: list[str] = Field(default_factory=list, description="engine URLs (backend external)")
    host: str = Field(default="127.0.0.1", min_length=1, description="address launched engines bind to")
    advertise_host: str | None = Field(default=None, min_length=1, description="host in the URLs of launched "
                                       "engines (what the trainer dials for weight sync); default: host, or this "
                                       "machine's name when host is 0.0.0.0 / ::")
    tp: int = Field(default=1, ge=1, le=64, description="tensor-parallel size of each engine")
    base_port: int = Field(default=30000, ge=1024, le=65000, description="first port for launched engines")
    startup_timeout_s: float = Field(default=300.0, gt=0, description="how long an engine may take to become healthy")
    request_timeout_s: float = Field(default=600.0, gt=0, description="timeout of one /generate call")
    coalesce_ms: float = Field(default=2.0, ge=0, le=1000,
                               description="sequences for one engine within this window go as one batch /generate (0: off)")
    coalesce_max: int = Field(default=32, ge=1, le=4096, description="most sequences in one batch /generate")
    threads: int | None = Field(default=None, ge=1, le=512, description="torch threads per reference engine (default 1)")
    health_interval_s: float = Field(default=1.0, gt=0, le=3600, description="seconds between engine health checks")
    health_failures: int = Field(default=3, ge=1, le=1000, description="failed checks before a live engine counts as down")
    restart: bool = Field(default=True, description="relaunch a launched engine that died or hung")
    max_restarts: int = Field(default=10, ge=0, le=100_000, description="restarts per engine before giving up on it")
    router_port: int | None = Field(default=None, ge=1024, le=65535, description="port of sglang-router (router: sglang); default a free port")


class DataConfig(_Section):
    path: str | None = Field(default=None, description="jsonl or parquet prompts (or null for a task)")
    task: str | None = Field(default=None, description="reasoning-gym task name, e.g. chain_sum")
    task_config: dict[str, Any] = Field(default_factory=dict, description="reasoning-gym dataset options")
    size: int = Field(default=100_000, ge=1, description="procedural task: items per epoch")
    input_key: str = Field(default="prompt", description="record key holding the prompt (str or messages)")
    prompt_template: str = Field(default="{prompt}", description="format string applied to the prompt text ({prompt})")
    label_key: str | None = Field(default="label", description="record key holding the ground truth")
    metadata_key: str | None = Field(default=None, description="record key copied into sample metadata")
    apply_chat_template: bool = Field(default=False, description="render prompts with the tokenizer's chat template")
    shuffle: bool = Field(default=True, description="shuffle each epoch")
    seed: int = Field(default=0, ge=0, description="shuffle / task seed")
    epochs: int | None = Field(default=None, ge=1, description="stop after this many epochs (null: forever)")
    eval_path: str | None = Field(default=None, description="held-out prompts for evaluation")
    eval_size: int = Field(default=64, ge=1, description="held-out items drawn for evaluation")


class SamplingConfig(_Section):
    temperature: float = Field(default=1.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 = off")
    max_new_tokens: int = Field(default=64, ge=1, le=1_000_000, description="max response length")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    def to_sglang(self) -> dict[str, Any]:
        """SGLang ``sampling_params`` for /generate."""
        d = self.model_dump()
        if not d["stop"]:
            d.pop("stop")
        if not d["stop_token_ids"]:
            d.pop("stop_token_ids")
        return d


class RolloutConfig(_Section):
    url: str = Field(default="http://127.0.0.1:8200", description="where clients reach the rollout service")
    host: str = Field(default="127.0.0.1")
    port: int = Field(default=8200, ge=0, le=65535)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    router: Literal["builtin", "sglang"] = Field(default="builtin", description="least-in-flight or sglang-router")
    router_args: list[str] = Field(default_factory=list, description="extra sglang-router arguments (router: sglang)")
    data: DataConfig = Field(default_factory=DataConfig)
    n_samples_per_prompt: int = Field(default=8, ge=1, le=1024, description="samples per group")
    groups_per_step: int = Field(default=16, ge=1, le=100_000, description="groups the trainer takes per step")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    eval_sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=0.0))
    generate: str | None = Field(default=None, description="module:function or file.py:function")
    reward: str = Field(default="exact_match", description="built-in name or module:function")
    filter: str | None = Field(default=None, description="keep_group filter: built-in name or module:function")
    mode: Literal["continuous", "on_demand"] = Field(default="continuous")
    max_concurrency: int = Field(default=64, ge=1, le=100_000, description="sequences in flight at once")
    max_prompt_length: int | None = Field(default=None, ge=1, description="longer prompts become failed samples")
    max_oversample: int = Field(default=8, ge=1, description="dynamic sampling: draw at most this x groups")
    state_path: str | None = Field(default=None, description="data cursor file; default <run.out>/rollout_state.json")
    reward_url: str | None = Field(default=None, description="reward model URL for reward: remote")
    reward_timeout_s: float = Field(default=60.0, gt=0, description="timeout of one reward call")
    run_id: str | None = Field(default=None, min_length=1, max_length=128,
                               description="prefix of group ids / uids (idempotency keys); default derived from run.out")
    push_batch: int = Field(default=64, ge=1, le=100_000, description="most groups sent in one POST /v1/groups")
    push_retry_max_s: float = Field(default=5.0, gt=0, description="longest wait between push retries (never gives up)")
    stats_interval_s: float = Field(default=0.5, gt=0, description="how often continuous mode polls the buffer's /v1/stats")


# ---- trainer ---------------------------------------------------------------------------------


class TrainerConfig(_Section):
    tp: int = Field(default=1, ge=1, le=512, description="tensor-parallel size")
    dp: int = Field(default=1, ge=1, le=100_000, description="data-parallel size")
    lr: float = Field(default=1.0e-5, gt=0, le=1.0)
    min_lr: float = Field(default=0.0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(default=1.0, ge=0, description="max grad norm; 0 disables")
    steps: int = Field(default=100, ge=1, le=10_000_000)
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo"] = "grpo"
    normalize_std: bool | None = Field(default=None, description="override the algorithm's std normalisation")
    clip_low: float = Field(default=0.2, ge=0, le=1)
    clip_high: float = Field(default=0.2, ge=0, le=10, description="> clip_low = clip-higher (DAPO)")
    dual_clip: float | None = Field(default=None, gt=1.0, description="dual-clip constant c (> 1)")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    kl_coef: float = Field(default=0.0, ge=0, description="KL-to-reference weight (0: no reference model)")
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = Field(default=False, description="apply KL as a reward term instead of a loss")
    entropy_coef: float = Field(default=0.0, ge=0)
    tis_cap: float | None = Field(default=None, gt=0, description="truncated importance sampling cap")
    ppo_epochs: int = Field(default=1, ge=1, le=100, description="optimizer passes over each batch")
    mini_batches: int = Field(default=1, ge=1, description="optimizer steps per batch")
    separate_old_logprobs: bool = Field(default=False, description="always recompute old logprobs in their own "
                                        "forward pass (else a single update, 1 epoch x 1 mini-batch, reuses its own)")
    micro_batch_tokens: int = Field(default=8192, ge=16, description="token budget of one packed micro-batch")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(default="auto", description="auto: bf16 on GPU, fp32 on CPU")
    seed: int = Field(default=1234, ge=0)
    checkpoint_dir: str | None = Field(default=None, description="default <run.out>/ckpt")
    save_every: int = Field(default=0, ge=0, description="checkpoint every N steps (0: only at the end)")
    lease_wait_s: float = Field(default=30.0, gt=0, description="wait per lease attempt")
    threads: int | None = Field(default=None, ge=1, le=512, description="torch threads per trainer rank")
    bucket_mb: float = Field(default=256.0, gt=0, description="weight-sync bucket size")
    sync_address: str = Field(default="127.0.0.1", description="address engines use to reach trainer rank 0 for weight sync")
    sync_timeout_s: float = Field(default=300.0, gt=0, description="timeout of each weight-sync step")
    tensorboard: bool = Field(default=False, description="also write TensorBoard scalars to <run.out>/tensorboard")
    export_hf: bool = Field(default=False, description="write the final policy as a HF directory")
    export_hf_dir: str | None = Field(default=None, description="where export_hf writes; default <run.out>/hf")
    weight_sync_hook: str | None = Field(
        default=None, description="module:function building the weight-sync hook (null: trainer.sync.EngineSync with a rollout URL, none without)")


# ---- run / placement -------------------------------------------------------------------------


class NumGpus(_Section):
    trainer: int = Field(default=4, ge=0)
    rollout: int = Field(default=4, ge=0)


class RunSection(_Section):
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    out: str = Field(default="runs/demo", description="output directory of the run")
    eval_every: int = Field(default=10, ge=0, description="evaluate every N steps (0: never)")
    num_gpus: NumGpus = Field(default_factory=NumGpus)
    engine_tp: int = Field(default=1, ge=1)
    warmup_sft_steps: int = Field(default=0, ge=0, description="supervised warm-up steps before RL (demo)")
    time_limit_s: float | None = Field(default=None, gt=0, description="stop the run after this long")


class HeadraceConfig(_Section):
    model: str = Field(default="models/tiny-qwen2", description="HF directory (config, safetensors, tokenizer)")
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunSection = Field(default_factory=RunSection)

    def resolved_path(self, value: str | None, default_name: str) -> Path:
        """A path from the config, or ``<run.out>/<default_name>`` when unset."""
        return Path(value) if value else Path(self.run.out) / default_name


# ---- loading ---------------------------------------------------------------------------------


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
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
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = err.get("input")
        lines.append(f"{key}: {msg}" + ("" if err["type"] == "extra_forbidden" else f" (got {got!r})"))
    return f"invalid configuration ({origin}):\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> HeadraceConfig:
    """Load a run config. ``overrides`` are dotted keys from command-line flags (None values skipped)."""
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
    for key, value in env_overrides(environ).items():
        _set_dotted(tree, key, value)
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
    try:
        return HeadraceConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, origin)) from None


def save_config(config: HeadraceConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML (next to a run's outputs)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return p


def rollout_mode(cfg: HeadraceConfig) -> Literal["continuous", "on_demand"]:
    """The rollout mode a run really uses: colocated placement is always ``on_demand`` (the
    engines must not generate while the trainer holds the devices); otherwise ``rollout.mode``.
    ``headrace run``, the Ray launcher and the trainer all decide it here."""
    return "on_demand" if cfg.run.placement == "colocated" else cfg.rollout.mode
