"""A module that only ranks started by tests/trainer/test_launch.py import (never the test process)."""

from __future__ import annotations

import os
from typing import Any


def rank_and_args(*args: Any) -> tuple[int, int, tuple[Any, ...]]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args


def fail_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 refuses")
    return 0
