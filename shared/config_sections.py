"""The sections of the run configuration, one pydantic model per service (``buffer``,
``rollout`` with its ``engines``, ``data`` and ``sampling``, ``trainer``, ``run``).

Every field has a description (what it does, its unit, which services read it) and a range; the
combined model, the cross-field rules and the loader are in ``headrace.shared.config``, which
re-exports these names. This module imports neither torch nor any service.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    read_by: ClassVar[str] = ""

def _by(services: str) -> dict[str, str]:
    """``json_schema_extra`` of a field read by other services than its section's."""
    return {"read_by": services}


# ---- auth ------------------------------------------------------------------------------------


class AuthConfig(_Section):
    """The run's one bearer token (DESIGN.md "Trust"), checked by every HTTP service, sent by every client."""

    read_by: ClassVar[str] = "every service"
    token: str | None = Field(
        default=None, min_length=1, repr=False,
        description="bearer token: with it, buffer, rollout service and engines answer 401 without "
                    "`Authorization: Bearer <token>` on every endpoint but /health (and /metrics); every client "
                    "sends it. Set it with the HEADRACE_TOKEN environment variable or `token_file`, never on a "
                    "command line; a saved config.yaml holds \"***\" in its place")
    token_file: str | None = Field(default=None, min_length=1,
                                   description="file holding the token (`--token-file` on every serve command); "
                                               "read when HEADRACE_TOKEN and `token` are unset")
    protect_metrics: bool = Field(default=False, description="also require the token on /metrics "
                                  "(Prometheus scrapers then need it)")


# ---- buffer ----------------------------------------------------------------------------------


class BufferConfig(_Section):
    """The durable sample buffer (``headrace buffer serve``) and how its clients reach it."""

    read_by: ClassVar[str] = "buffer"
    url: str = Field(default="http://127.0.0.1:8100", min_length=1, json_schema_extra=_by("rollout, trainer"),
                     description="URL where clients reach the buffer (`--buffer-url` overrides it)")
    host: str = Field(default="127.0.0.1", min_length=1, description="interface the buffer binds")
    port: int = Field(default=8100, ge=0, le=65535, description="TCP port the buffer binds "
                      "(`headrace run` takes a free one when it is busy)")
    db: str | None = Field(default=None, min_length=1, description="SQLite file (durable, WAL mode; the groups' "
                           "payloads go to segment files in `<db>.blobs/` beside it); default "
                           "`<run.out>/buffer.sqlite` under `headrace run`, `./buffer.sqlite` otherwise; "
                           "not with `memory`")
    memory: bool = Field(default=False, description="keep every group in memory: faster, lost when the buffer stops")
    durability: Literal["process_crash", "power_loss"] = Field(
        default="process_crash",
        description="what a group answered 200 survives: `process_crash` (kill -9 of the buffer; SQLite WAL with "
                    "synchronous=NORMAL: the commit is in the OS page cache, no fsync per request) or `power_loss` "
                    "(also an OS crash or power loss: synchronous=FULL, an fsync per commit, shared by the requests "
                    "that arrive together)")
    capacity: int = Field(default=4096, ge=1, le=10_000_000,
                          description="most groups queued + leased, in groups; a push beyond it is answered 429")
    max_staleness: int = Field(
        default=1, ge=0, le=1_000_000, json_schema_extra=_by("buffer, rollout, trainer"),
        description="policy versions a group may lag: the buffer evicts groups with weight_version < "
                    "policy_version - max_staleness; the same number sets the rollout's admission cap "
                    "((max_staleness + 1) x groups_per_step groups queued, leased or in flight) and the "
                    "trainer's lease floor (it leases no group older than policy_version - max_staleness)")
    max_body_mb: float = Field(default=64.0, gt=0, le=4096,
                               description="largest accepted request body, in MiB; larger is answered 413")
    lease_s: float = Field(default=600.0, gt=0, le=86_400, json_schema_extra=_by("trainer"),
                           description="seconds a trainer lease lasts before its groups return to the queue")


# ---- rollout ---------------------------------------------------------------------------------


class EnginesConfig(_Section):
    """The inference engines the rollout service generates with."""

    read_by: ClassVar[str] = "rollout"
    backend: Literal["reference", "sglang", "vllm", "external"] = Field(
        default="reference", description="`reference`: launch `headrace engine serve` (CPU); `sglang`: launch "
                                         "SGLang servers; `vllm`: launch vLLM 0.32 servers from `python` (or attach "
                                         "to vLLM `urls`), each behind an SGLang-API adapter; `external`: attach "
                                         "to `urls` started elsewhere")
    count: int = Field(default=1, ge=1, le=1024, description="engines to launch (reference, sglang); "
                       "`headrace launch` starts run.num_gpus.rollout / tp instead")
    python: str | None = Field(default=None, min_length=1, json_schema_extra=_by("rollout, headrace launch"),
                               description="python of the SGLang venv (backend sglang, router sglang) or of "
                                           "the vLLM venv (backend vllm, e.g. .venv-vllm/bin/python); "
                                           "default this interpreter")
    args: list[str] = Field(default_factory=list, json_schema_extra=_by("rollout, headrace launch"),
                            description="extra command-line arguments of every launched engine")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of launched engines "
                                "(e.g. SGLANG_USE_CPU_ENGINE: '1')")
    urls: list[str] = Field(default_factory=list, description="engine URLs (backend external; required there; "
                            "backend vllm: attach to these vLLM servers instead of launching)")
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

    @model_validator(mode="after")
    def _vllm_is_single_gpu(self) -> "EnginesConfig":
        if self.backend == "vllm" and self.tp > 1:   # the adapter reports tp_size 1; weight sync would use tp ranks
            raise ValueError(f"tp {self.tp} with backend vllm: each vLLM engine here is one GPU (its SGLang-API "
                             "adapter and weight sync serve tensor-parallel size 1); set tp: 1 and count: N")
        return self


class ShardConfig(_Section):
    """This rollout service's place among several feeding one buffer: its share of the prompts (slot i of
    each epoch goes to i % count) and of the continuous admission cap; with ``split: false`` of the cap alone."""

    read_by: ClassVar[str] = "rollout"
    index: int = Field(default=0, ge=0, le=100_000, description="this service's shard, 0 <= index < count")
    count: int = Field(default=1, ge=1, le=100_000, description="rollout services sharing the prompts "
                       "(each with its own index, the same data, seed and shuffle)")
    weights: list[int] | None = Field(
        default=None, description="continuous mode: each service's share of the admission cap, in "
        "proportion: one integer 1..1000000 per service, the same list in every service's config (e.g. "
        "their engine counts; `headrace run` sets them); null: even shares")
    split: bool = Field(default=True, description="true: the services share one set of prompts and this one "
                        "draws only its shard of them; false: it draws every prompt of its own data (services over "
                        "different data on one buffer) and keeps only its share of the admission cap, its own "
                        "cursor file and its own group ids")

    @model_validator(mode="after")
    def _index_below_count(self) -> "ShardConfig":
        if self.index >= self.count:
            raise ValueError(f"index {self.index} is not below count {self.count}: shards are numbered "
                             f"0..{self.count - 1}")
        if self.weights is not None and len(self.weights) != self.count:
            raise ValueError(f"weights has {len(self.weights)} entries but count is {self.count}: give one "
                             "weight per service (e.g. its engine count)")
        if self.weights is not None and not all(1 <= w <= 1_000_000 for w in self.weights):
            raise ValueError(f"weights {self.weights}: each must be an integer from 1 to 1000000")
        return self


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
    shard: ShardConfig | None = Field(default=None, description="several rollout services on one buffer: this "
                                      "one draws only its shard's prompts (every prompt of its own data with "
                                      "`split: false`), with its own cursor file (`state_path` "
                                      "with `.shard<index>of<count>` before its suffix); evaluation still uses every "
                                      "held-out prompt (null: every prompt)")


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


class GatewayConfig(_Section):
    """The agent gateway of the rollout service: episodes and the OpenAI-compatible API at /openai/v1."""

    read_by: ClassVar[str] = "rollout"
    model_name: str | None = Field(default=None, min_length=1, max_length=256,
                                   description="model id the OpenAI API serves (GET /openai/v1/models; a request "
                                               "naming another model is a 404); default the model directory's name")
    episode_timeout_s: float = Field(default=600.0, gt=0, le=7 * 86_400,
                                     description="seconds an episode may stay idle (no call, no finish) before it is "
                                                 "finished as failed (reward null)")
    call_timeout_s: float = Field(default=600.0, gt=0, le=86_400,
                                  description="seconds one OpenAI call may take, waiting through a pause or weight "
                                              "sync included; beyond it the call is answered 503")


class RolloutConfig(_Section):
    """The rollout service (``headrace rollout serve``): data, engines, generation, rewards, filter."""

    read_by: ClassVar[str] = "rollout"
    url: str = Field(default="http://127.0.0.1:8200", min_length=1, json_schema_extra=_by("trainer"),
                     description="URL where the trainer reaches the rollout service (`--rollout-url` overrides it)")
    extra_urls: list[str] = Field(default_factory=list, json_schema_extra=_by("trainer"),
                                  description="URLs of further rollout services (scale-out: each with its own "
                                              "`data.shard`) whose engines the trainer syncs together with `url`'s; "
                                              "`headrace train` sets it from its second and later `--rollout-url`")
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
    agent: str | None = Field(default=None, min_length=1, description="in-service agent: module:function or "
                              "file.py:function, `async def agent(ctx, task) -> float | None` driving `ctx.client` "
                              "(an openai.AsyncOpenAI bound to a fresh episode), run n_samples_per_prompt times per "
                              "prompt as one group (instead of `generate`)")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
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
    max_body_mb: float = Field(default=1.0, gt=0, le=1024, description="largest request body of the control API, "
                               "in MiB; larger is answered 413")


# ---- trainer ---------------------------------------------------------------------------------


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(_Section):
    """Low-rank adapters on the decoder's linear layers (DESIGN.md "LoRA"); the base stays frozen."""

    read_by: ClassVar[str] = "trainer"
    rank: int = Field(default=16, ge=1, le=65_536, description="adapter rank r (>= 1)")
    alpha: float | None = Field(default=None, gt=0, le=1_000_000, description="LoRA alpha (> 0); the adapter "
                                "output is scaled by alpha / rank (null: 2 x rank)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter input, in the training "
                           "forward only (old-logprob, reference and evaluation passes run without it)")
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1,
                                      description="Hugging Face module names that get adapters: a subset of "
                                                  + ", ".join(LORA_TARGETS))

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in LORA_TARGETS]
        if bad:
            raise ValueError(f"unknown target module(s) {bad}; valid: {', '.join(LORA_TARGETS)}")
        return list(dict.fromkeys(v))

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor of the adapter's output."""
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank


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
                            description="checkpoint every N steps (0: only at the end; `headrace run` uses 10); "
                                        "groups are acked only once a checkpoint contains them, so this trades "
                                        "checkpoint cost against replay after a crash (at most N steps' groups "
                                        "are trained again)")
    max_rejected_fraction: float = Field(default=0.1, ge=0, le=1, json_schema_extra=_by("trainer"),
                                         description="groups the trainer refuses (token outside the vocabulary, "
                                                     "prompts differing within a group, no trainable token, ...) "
                                                     "are dead-lettered and training goes on; it stops when more "
                                                     "than this fraction of the groups it leased (counted as at "
                                                     "least steps x groups_per_step) were rejected")
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
    lora: LoRAConfig | None = Field(default=None, description="low-rank adapters instead of full fine-tuning "
                                    "(null: full fine-tuning); see the trainer.lora keys")
    lora_sync: Literal["merged", "adapter"] = Field(
        default="merged", description="with trainer.lora, what a weight sync sends: merged (the targeted weights "
                                      "W + alpha / rank * B A, any engine) or adapter (a PEFT adapter loaded through "
                                      "the engines' /load_lora_adapter)")
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
    rollout_services: int = Field(
        default=1, ge=1, le=1024, description="rollout services the run starts (scale-out: one service drives a "
        "few hundred GPUs' worth of engines, see bench/fleet_sim.py); the engines are split between them in "
        "contiguous blocks, each service gets its own rollout.data.shard and port, and the trainer drives them all")
