"""trainer.launch.spawn with a ``Lazy`` function: real processes; the launcher never imports it."""

from __future__ import annotations

import sys

import pytest

from headrace.trainer.launch import Lazy, spawn

TARGET = "tests.trainer.lazy_target"


def test_a_lazy_function_runs_in_every_rank_and_is_imported_there_only() -> None:
    assert TARGET not in sys.modules
    results = spawn(Lazy(TARGET, "rank_and_args"), 2, "a", [1, 2], timeout_s=120)
    assert results == [(0, 2, ("a", [1, 2])), (1, 2, ("a", [1, 2]))]
    assert TARGET not in sys.modules   # `headrace train` hands its ranks run_training_from_dict this way


def test_a_lazy_function_that_raises_is_reported_by_its_name() -> None:
    with pytest.raises(RuntimeError, match="rank 1 refuses") as e:
        spawn(Lazy(TARGET, "fail_on_rank_1"), 2, timeout_s=120)
    assert "ValueError" in str(e.value)
    with pytest.raises(RuntimeError, match="no_such_function"):
        spawn(Lazy(TARGET, "no_such_function"), 1, timeout_s=120)
