"""Per-step trainer metrics: one JSON object per line, and optionally TensorBoard scalars.

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
