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

This module imports neither torch nor any service.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "HEADRACE_"


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    read_by: ClassVar[str] = ""

def _by(services: str) -> dict[str, str]:
    """``json_schema_extra`` of a field read by other services than its section's."""
    return {"read_by": services}


# ---- buffer ----------------------------------------------------------------------------------


class BufferConfig(_Section):
    """The durable sample buffer (``headrace buffer serve``) and how its clients reach it."""

    read_by: ClassVar[str] = "buffer"
    url: str = Field(default="http://127.0.0.1:8100", min_length=1, json_schema_extra=_by("rollout, trainer"),
                     description="URL where clients reach the buffer (`--buffer-url` overrides it)")
    host: str = Field(default="127.0.0.1", min_length=1, description="interface the buffer binds")
    port: int = Field(default=8100, ge=0, le=65535, description="TCP port the buffer binds "
                      "(`headrace run` takes a free one when it is busy)")
    db: str | None = Field(default=None, min_length=1, description="SQLite file (durable, WAL mode); default "
                           "`<run.out>/buffer.sqlite` under `headrace run`, `./buffer.sqlite` otherwise; "
                           "not with `memory`")
    memory: bool = Field(default=False, description="keep every group in memory: faster, lost when the buffer stops")
    capacity: int = Field(default=4096, ge=1, le=10_000_000,
                          description="most groups queued + leased, in groups; a push beyond it is answered 429")
    max_staleness: int = Field(
        default=1, ge=0, le=1_000_000, json_schema_extra=_by("buffer, rollout, trainer"),
        description="policy versions a group may lag: the buffer evicts groups with weight_version < "
                    "policy_version - max_staleness; the same number sets the rollout's admission cap "
                    "((max_staleness + 1) x groups_per_step groups queued, leased or in flight) and the "
                    "trainer's lease floor (it leases no group older than policy_version - max_staleness)")
    token: str | None = Field(default=None, min_length=1, json_schema_extra=_by("buffer, rollout, trainer"),
                              description="bearer token: the buffer answers 401 without it on every endpoint but "
                                          "/health and /metrics; rollout and trainer send it. Keep it out of "
                                          "command lines: HEADRACE_BUFFER__TOKEN or `--token-file`")
    max_body_mb: float = Field(default=64.0, gt=0, le=4096,
                               description="largest accepted request body, in MiB; larger is answered 413")
    lease_s: float = Field(default=600.0, gt=0, le=86_400, json_schema_extra=_by("trainer"),
                           description="seconds a trainer lease lasts before its groups return to the queue")


# ---- rollout ---------------------------------------------------------------------------------


class EnginesConfig(_Section):
    """The inference engines the rollout service generates with."""

    read_by: ClassVar[str] = "rollout"
    backend: Literal["reference", "sglang", "external"] = Field(
        default="reference", description="`reference`: launch `headrace engine serve` (CPU); `sglang`: launch "
                                         "SGLang servers; `external`: attach to `urls` started elsewhere")
    count: int = Field(default=1, ge=1, le=1024, description="engines to launch (reference, sglang); "
                       "`headrace launch` starts run.num_gpus.rollout / tp instead")
    python: str | None = Field(default=None, min_length=1, json_schema_extra=_by("rollout, headrace launch"),
                               description="python of the SGLang venv (backend sglang, router sglang); "
                                           "default this interpreter")
    args: list[str] = Field(default_factory=list, json_schema_extra=_by("rollout, headrace launch"),
                            description="extra command-line arguments of every launched engine")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of launched engines "
                                "(e.g. SGLANG_USE_CPU_ENGINE: '1')")
    urls: list[str] = Field(default_factory=list, description="engine URLs (backend external; required there)")
    host: str = Field(default="127.0.0.1", min_length=1, description="address launched engines bind to")
    advertise_host: str | None = Field(default=None, min_length=1, description="host in the URLs of launched "
                                       "engines (what the trainer dials for weight sync); default: host, or this "
                                       "machine's name when host is 0.0.0.0 / ::")
    tp: int = Field(default=1, ge=1, le=64, json_schema_extra=_by("rollout, headrace launch"),
                    description="tensor-parallel size of each engine, in GPUs (SGLang `--tp-size`; "
                                "`headrace launch` places each engine on this many bundles of one node)")
    base_port: int = Field(default=30000, ge=1024, le=65000, json_schema_extra=_by("rollout, headrace run"),
                           description="TCP port of the first launched engine; the next ones count up")
    startup_timeout_s: float = Field(default=300.0, gt=0, le=86_400,
                                     json_schema_extra=_by("rollout, headrace run, headrace launch"),
                                     description="seconds an engine may take to answer /health")
    request_timeout_s: float = Field(default=600.0, gt=0, le=86_400, description="seconds one /generate call may take")
    coalesce_ms: float = Field(default=2.0, ge=0, le=1000, description="milliseconds within which sequences for one "
                               "engine go as one batch /generate (0: off)")
    coalesce_max: int = Field(default=32, ge=1, le=4096, description="most sequences in one batch /generate")
    threads: int | None = Field(default=None, ge=1, le=512, description="torch threads per reference engine "
                                "(default 1)")
    health_interval_s: float = Field(default=1.0, gt=0, le=3600, description="seconds between engine health checks")
    health_failures: int = Field(default=3, ge=1, le=1000, description="failed health checks in a row before a "
                                 "live engine counts as down")
    restart: bool = Field(default=True, description="relaunch a launched engine that died or hung")
    max_restarts: int = Field(default=10, ge=0, le=100_000, description="restarts per engine before giving up on it")
    router_port: int | None = Field(default=None, ge=1024, le=65535, description="TCP port of sglang-router "
                                    "(router sglang); default a free port")


class DataConfig(_Section):
    """The prompts: a jsonl / parquet file or a reasoning-gym task (one of the two)."""

    read_by: ClassVar[str] = "rollout"
    path: str | None = Field(default=None, min_length=1, description="jsonl or parquet file of prompt records "
                             "(or use `task`)")
    task: str | None = Field(default=None, min_length=1, description="reasoning-gym task name, e.g. chain_sum "
                             "(or use `path`)")
    task_config: dict[str, Any] = Field(default_factory=dict, description="reasoning-gym dataset options of `task`")
    size: int = Field(default=100_000, ge=1, le=100_000_000, description="`task`: items per epoch")
    input_key: str = Field(default="prompt", min_length=1, description="record key holding the prompt "
                           "(a string or chat messages)")
    prompt_template: str = Field(default="{prompt}", description="format string applied to the prompt text "
                                 "({prompt} is replaced)")
    label_key: str | None = Field(default="label", description="record key holding the ground truth "
                                  "(passed to the reward)")
    metadata_key: str | None = Field(default=None, description="record key copied into sample metadata")
    apply_chat_template: bool = Field(default=False, description="render prompts with the tokenizer's chat template")
    shuffle: bool = Field(default=True, description="shuffle each epoch (seeded by `seed` and the epoch)")
    seed: int = Field(default=0, ge=0, description="seed of the shuffle and of `task`'s generator")
    epochs: int | None = Field(default=None, ge=1, description="stop generating after this many epochs "
                               "(null: forever)")
    eval_path: str | None = Field(default=None, min_length=1, description="held-out prompts for evaluation "
                                  "(jsonl / parquet; with `task` they are drawn from the task)")
    eval_size: int = Field(default=64, ge=1, le=1_000_000, description="`task`: held-out items drawn for evaluation")


class SamplingConfig(_Section):
    """Sampling parameters of every /generate call (SGLang `sampling_params`)."""

    read_by: ClassVar[str] = "rollout"
    temperature: float = Field(default=1.0, ge=0.0, le=10.0, description="softmax temperature (0: greedy)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass (1: off)")
    top_k: int = Field(default=-1, ge=-1, description="sample among the k likeliest tokens (-1: off)")
    max_new_tokens: int = Field(default=64, ge=1, le=1_000_000, description="most generated tokens per response")
    stop: list[str] = Field(default_factory=list, description="strings that end a response")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a response")
    ignore_eos: bool = Field(default=False, description="keep generating past the end-of-sequence token")

    def to_sglang(self) -> dict[str, Any]:
        """SGLang ``sampling_params`` for /generate."""
        d = self.model_dump()
        if not d["stop"]:
            d.pop("stop")
        if not d["stop_token_ids"]:
            d.pop("stop_token_ids")
        return d


class RolloutConfig(_Section):
    """The rollout service (``headrace rollout serve``): data, engines, generation, rewards, filter."""

    read_by: ClassVar[str] = "rollout"
    url: str = Field(default="http://127.0.0.1:8200", min_length=1, json_schema_extra=_by("trainer"),
                     description="URL where the trainer reaches the rollout service (`--rollout-url` overrides it)")
    host: str = Field(default="127.0.0.1", min_length=1, description="interface the rollout service binds")
    port: int = Field(default=8200, ge=0, le=65535, description="TCP port the rollout service binds "
                      "(`headrace run` takes a free one when it is busy)")
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    router: Literal["builtin", "sglang"] = Field(default="builtin", description="`builtin`: least-in-flight "
                                                 "routing here; `sglang`: sglang-router (in engines.python)")
    router_args: list[str] = Field(default_factory=list, description="extra sglang-router arguments (router sglang)")
    data: DataConfig = Field(default_factory=DataConfig)
    n_samples_per_prompt: int = Field(default=8, ge=1, le=1024, description="samples per group (one prompt)")
    groups_per_step: int = Field(default=16, ge=1, le=100_000, json_schema_extra=_by("rollout, trainer"),
                                 description="groups the trainer leases per step (and on_demand mode generates)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    eval_sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=0.0))
    generate: str | None = Field(default=None, min_length=1, description="custom generator: module:function or "
                                 "file.py:function (default: one /generate per sample)")
    reward: str = Field(default="exact_match", min_length=1, description="reward: a built-in (exact_match, math, "
                        "reasoning_gym, reasoning_gym_binary, remote) or module:function")
    filter: str | None = Field(default=None, min_length=1, description="group filter: a built-in name "
                               "(e.g. zero_variance) or module:function (null: keep every group)")
    mode: Literal["continuous", "on_demand"] = Field(
        default="continuous", json_schema_extra=_by("rollout, trainer"),
        description="`continuous`: generate ahead within buffer.max_staleness; `on_demand`: generate a step's "
                    "groups when the trainer asks. run.placement colocated always means on_demand")
    max_concurrency: int = Field(default=64, ge=1, le=100_000, description="sequences in flight at once")
    max_prompt_length: int | None = Field(default=None, ge=1, description="tokens; a longer prompt becomes a "
                                          "failed sample (null: no limit)")
    max_oversample: int = Field(default=8, ge=1, le=1000, description="with a filter: draw at most this many "
                                "times groups_per_step groups for one on_demand step")
    state_path: str | None = Field(default=None, min_length=1, description="data cursor file; default "
                                   "`<run.out>/rollout_state.json`")
    reward_url: str | None = Field(default=None, min_length=1, description="URL the `remote` reward POSTs each "
                                   "sample to (required with reward: remote)")
    reward_timeout_s: float = Field(default=60.0, gt=0, le=86_400, description="seconds one reward call may take")
    run_id: str | None = Field(default=None, min_length=1, max_length=128,
                               description="prefix of group ids / uids (the buffer's idempotency keys); default "
                                           "derived from state_path")
    push_batch: int = Field(default=64, ge=1, le=100_000, description="most groups sent in one POST /v1/groups")
    push_retry_max_s: float = Field(default=5.0, gt=0, le=3600, description="longest wait between push retries, in "
                                    "seconds (pushes never give up)")
    stats_interval_s: float = Field(default=0.5, gt=0, le=3600, description="seconds between continuous mode's "
                                    "polls of the buffer's /v1/stats")


# ---- trainer ---------------------------------------------------------------------------------


class TrainerConfig(_Section):
    """The trainer (``headrace train``): parallelism, optimizer, RL loss, checkpoints, weight sync."""

    read_by: ClassVar[str] = "trainer"
    tp: int = Field(default=1, ge=1, le=512, json_schema_extra=_by("trainer, headrace launch"),
                    description="tensor-parallel size (ranks per model replica)")
    dp: int = Field(default=1, ge=1, le=100_000, json_schema_extra=_by("trainer, headrace launch"),
                    description="data-parallel size (replicas); the trainer runs tp x dp ranks")
    lr: float = Field(default=1.0e-5, gt=0, le=1.0, description="peak learning rate (AdamW)")
    min_lr: float = Field(default=0.0, ge=0, le=1.0, description="final learning rate of the cosine schedule "
                          "(<= lr)")
    lr_schedule: Literal["constant", "cosine"] = Field(default="constant", description="learning-rate schedule "
                                                       "after warm-up")
    warmup_steps: int = Field(default=0, ge=0, description="steps of linear learning-rate warm-up")
    weight_decay: float = Field(default=0.0, ge=0, le=10, description="AdamW weight decay (not on biases and norms)")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas, each in [0, 1)")
    grad_clip: float = Field(default=1.0, ge=0, description="largest global gradient norm (0: no clipping)")
    steps: int = Field(default=100, ge=1, le=10_000_000, description="optimizer steps (policy versions) of the run")
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo"] = Field(
        default="grpo", description="advantage estimator and loss")
    normalize_std: bool | None = Field(default=None, description="divide advantages by the group's reward std "
                                       "(null: the algorithm's choice)")
    clip_low: float = Field(default=0.2, ge=0, le=1, description="PPO ratio clip below 1 (1 - clip_low)")
    clip_high: float = Field(default=0.2, ge=0, le=10, description="PPO ratio clip above 1 (1 + clip_high); "
                             "> clip_low is clip-higher (DAPO)")
    dual_clip: float | None = Field(default=None, gt=1.0, le=100, description="dual-clip constant c for negative "
                                    "advantages (null: off)")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = Field(
        default="token_mean", description="how token losses are averaged (gspo always uses seq_mean_token_mean)")
    kl_coef: float = Field(default=0.0, ge=0, le=100, description="KL-to-reference weight (0: no reference model)")
    kl_kind: Literal["k1", "k2", "k3"] = Field(default="k3", description="KL estimator")
    kl_in_reward: bool = Field(default=False, description="apply KL as a reward term instead of a loss term")
    entropy_coef: float = Field(default=0.0, ge=0, le=100, description="weight of the entropy bonus")
    tis_cap: float | None = Field(default=None, gt=0, description="truncated importance sampling cap on "
                                  "trainer / engine probability ratios (null: off)")
    ppo_epochs: int = Field(default=1, ge=1, le=100, description="optimizer passes over each batch")
    mini_batches: int = Field(default=1, ge=1, le=10_000, description="optimizer steps per batch")
    separate_old_logprobs: bool = Field(default=False, description="always recompute old logprobs in their own "
                                        "forward pass (else a single update, 1 epoch x 1 mini-batch, reuses its own)")
    micro_batch_tokens: int = Field(default=8192, ge=16, le=100_000_000, description="token budget of one packed "
                                    "micro-batch")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(default="auto", description="parameter dtype "
                                                          "(auto: bf16 on GPU, fp32 on CPU)")
    seed: int = Field(default=1234, ge=0, description="seed of torch, random and numpy on every rank")
    checkpoint_dir: str | None = Field(default=None, min_length=1, description="checkpoint directory; default "
                                       "`<run.out>/ckpt`")
    save_every: int = Field(default=0, ge=0, json_schema_extra=_by("trainer, headrace run"),
                            description="checkpoint every N steps (0: only at the end; `headrace run` uses 10)")
    lease_wait_s: float = Field(default=30.0, gt=0, le=86_400, description="seconds to wait for a full step of "
                                "groups per lease attempt (train-only mode stops after one empty attempt)")
    threads: int | None = Field(default=None, ge=1, le=512, json_schema_extra=_by("trainer, headrace run"),
                                description="torch threads per trainer rank (default CPUs / ranks; "
                                            "`headrace run`: 1)")
    bucket_mb: float = Field(default=256.0, gt=0, le=65_536, description="MiB per weight-sync bucket and per "
                             "gradient all-reduce bucket")
    sync_address: str = Field(default="127.0.0.1", min_length=1, description="address engines use to reach "
                              "trainer rank 0 for weight sync (`headrace launch` sets rank 0's node)")
    sync_timeout_s: float = Field(default=300.0, gt=0, le=86_400, description="seconds each weight-sync step may take")
    tensorboard: bool = Field(default=False, description="also write TensorBoard scalars to `<run.out>/tensorboard`")
    export_hf: bool = Field(default=False, json_schema_extra=_by("trainer, headrace run"),
                            description="write the final policy as a HF directory (`headrace run` always does)")
    export_hf_dir: str | None = Field(default=None, min_length=1, description="where export_hf writes; default "
                                      "`<run.out>/hf`")
    weight_sync_hook: str | None = Field(
        default=None, min_length=1, description="module:function `factory(config, info, rollout_url)` returning the "
                                                "trainer's RolloutControl (generation, memory, pause, weight sync, "
                                                "evaluation phases; null: trainer.rollout_control.EngineControl with a "
                                                "rollout URL, NoRollout without)")


# ---- run / placement -------------------------------------------------------------------------


class NumGpus(_Section):
    """GPUs of a Ray launch (``headrace launch``); unused on one machine."""

    read_by: ClassVar[str] = "headrace launch"
    trainer: int = Field(default=4, ge=0, le=100_000, description="GPUs of the trainer; must equal "
                         "trainer.tp x trainer.dp")
    rollout: int = Field(default=4, ge=0, le=100_000, description="GPUs of the engines: "
                         "rollout.engines.tp divides it, one engine per tp GPUs")


class RunSection(_Section):
    """The run as a whole: placement, outputs, evaluation."""

    read_by: ClassVar[str] = "headrace run, headrace launch"
    placement: Literal["colocated", "disaggregated"] = Field(
        default="disaggregated", json_schema_extra=_by("headrace run, headrace launch, trainer"),
        description="`colocated`: trainer and engines share GPUs, rollout on_demand; `disaggregated`: "
                    "separate GPUs, rollout.mode as set")
    out: str = Field(default="runs/demo", min_length=1, json_schema_extra=_by("every service"),
                     description="output directory of the run (config.yaml, metrics, logs, default paths)")
    eval_every: int = Field(default=10, ge=0, json_schema_extra=_by("trainer"),
                            description="evaluate on the held-out prompts every N steps and at step 0 "
                                        "(0: never; needs rollout.data.eval_path or rollout.data.task)")
    num_gpus: NumGpus = Field(default_factory=NumGpus)


class HeadraceConfig(_Section):
    """One run: a section per service plus ``run``; ``model`` is shared by rollout and trainer."""

    read_by: ClassVar[str] = "rollout, trainer"
    model: str = Field(default="models/tiny-qwen2", min_length=1,
                       description="HF model directory (config, safetensors, tokenizer); engines load it too")
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunSection = Field(default_factory=RunSection)

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
    if t.min_lr > t.lr:
        out.append(f"trainer.min_lr ({t.min_lr}) exceeds trainer.lr ({t.lr})")
    if not all(0.0 <= beta < 1.0 for beta in t.betas):
        out.append(f"trainer.betas {list(t.betas)}: each must be in [0, 1)")
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
    """Write the resolved config as YAML (next to a run's outputs), readable by its owner only
    (mode 0600): it may hold ``buffer.token``, which services started from it read there."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)           # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return p


def rollout_mode(cfg: HeadraceConfig) -> Literal["continuous", "on_demand"]:
    """The rollout mode a run really uses: colocated placement is always ``on_demand`` (the
    engines must not generate while the trainer holds the devices); otherwise ``rollout.mode``.
    ``headrace run``, the Ray launcher and the trainer all decide it here."""
    return "on_demand" if cfg.run.placement == "colocated" else cfg.rollout.mode

