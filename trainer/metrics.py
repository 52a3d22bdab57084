"""Per-step trainer metrics: the row of a step (``step_row`` / ``StepMetrics``) and where it goes
(``MetricsWriter``: one JSON object per line, and optionally TensorBoard scalars).

A step's row is ``train_step``'s metrics, the rollout's phase times (``generate_s``,
``weight_sync_s``, ...), the evaluation when one ran (``eval_score``, ...), and the loop's own
columns: ``policy_version`` (= ``weight_version``), ``data_weight_version`` (the oldest policy that
generated a group of the batch), ``staleness``, ``lease_wait_s``, ``iteration_s`` and
``samples_per_s``. Two KL columns, never one that changes meaning: ``approx_kl`` (the updated
policy against the policy that computed the old logprobs, every step) and ``kl_ref`` (against the
frozen reference, only when ``trainer.kl_coef > 0``).

Guarantees: each ``log`` call appends exactly one complete line and flushes it (readers such as
``headrace run``'s progress bar see whole lines only); non-finite floats are written as null so
the file stays valid JSON. TensorBoard needs the ``tensorboard`` package; asking for it without the
package is a clear error at start, not a silent no-op.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def step_row(train: dict[str, Any], *, policy_version: int, data_weight_version: int, lease_wait_s: float,
             samples: int, iteration_s: float, phases: dict[str, Any] | None = None,
             evals: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metrics row of one step (see the module docstring)."""
    if "kl" in train:
        raise ValueError("train metrics carry an ambiguous 'kl' column; name it kl_ref or approx_kl")
    return {**train, **(phases or {}), **(evals or {}),
            "policy_version": policy_version, "weight_version": policy_version,
            "data_weight_version": data_weight_version, "staleness": policy_version - 1 - data_weight_version,
            "lease_wait_s": lease_wait_s, "iteration_s": iteration_s,
            "samples_per_s": samples / iteration_s if iteration_s > 0 else 0.0}


class StepMetrics:
    """Builds each step's row on every rank and writes it where ``writer`` is set (rank 0).

    ``start_step`` starts the iteration clock; ``log_step`` stops it, so ``iteration_s`` covers
    everything the loop did for the step (generation, lease wait, training, sync, ack, evaluation).
    """

    def __init__(self, writer: "MetricsWriter | None") -> None:
        self.writer = writer
        self.last: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    def start_step(self) -> None:
        self._t0 = time.perf_counter()

    def log_baseline(self, step: int, policy_version: int, evals: dict[str, Any]) -> None:
        """The evaluation before the first step of a fresh run, as a row of its own (if there is one)."""
        if evals and self.writer is not None:
            self.writer.log({"step": step, "policy_version": policy_version, **evals})

    def log_step(self, train: dict[str, Any], policy_version: int, leased: Any, phases: dict[str, Any],
                 evals: dict[str, Any]) -> dict[str, Any]:
        """Build (and on rank 0 write) the row of the step that trained on ``leased`` (a ``Leased``)."""
        self.last = step_row(train, policy_version=policy_version, data_weight_version=leased.weight_version,
                             lease_wait_s=leased.wait_s, samples=len(leased.batch.samples),
                             iteration_s=time.perf_counter() - self._t0, phases=phases, evals=evals)
        if self.writer is not None:
            self.writer.log(self.last)
        return self.last

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    """Append-only JSONL metrics (``path``), plus TensorBoard event files under ``tensorboard_dir``."""

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("trainer.tensorboard is true but the tensorboard package is not installed "
                                   "(pip install tensorboard)") from e
            self._tb = SummaryWriter(str(tensorboard_dir))

    def log(self, row: dict[str, Any]) -> None:
        row = {"time": time.time(), **{k: _clean(v) for k, v in row.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in row:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None and k not in ("step", "time"):
                    self._tb.add_scalar(f"train/{k}", v, row["step"])
            self._tb.flush()

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
