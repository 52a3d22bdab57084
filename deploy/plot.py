"""Plot a run's metrics.jsonl: reward and eval score over steps, and the loss, to one PNG.

Reads only the file; safe to call on a run in progress. Uses matplotlib's Agg backend (no screen).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a partially written last line is skipped)."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_metrics(metrics_path: Path, out_png: Path, title: str = "headrace run") -> Path:
    """Write ``out_png`` with reward_mean and eval_score (left) and loss (right) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "step" in r]
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows if r.get("reward_mean") is not None]
    ax_r.plot(steps, [r["reward_mean"] for r in rows if r.get("reward_mean") is not None], label="train reward (mean)", alpha=0.7)
    ev = [(r["step"], r["eval_score"]) for r in rows if r.get("eval_score") is not None]
    if ev:
        ax_r.plot([s for s, _ in ev], [v for _, v in ev], "o-", label="eval score (pass@1)")
    ax_r.set_xlabel("step")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.legend(loc="lower right")
    ax_r.grid(alpha=0.3)
    loss = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    if loss:
        ax_l.plot([s for s, _ in loss], [v for _, v in loss], color="tab:red", label="loss")
    ax_l.set_xlabel("step")
    ax_l.legend(loc="upper right")
    ax_l.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
