"""Fixtures of the rollout tests. ``stacks``: a factory of buffer + rollout service stacks (real
processes, tests/rollout/support.py ``Stack``), each stopped by pid when the test ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.rollout.support import Stack


@pytest.fixture
def stacks(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """``stacks(model, rollout_config, **kw)`` makes a Stack under tmp_path (start it yourself);
    every Stack made is stopped when the test ends."""
    made: list[Stack] = []

    def make(model: Path, rollout: dict[str, Any], **kw: Any) -> Stack:
        s = Stack(tmp_path / f"s{len(made)}", model, rollout, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
