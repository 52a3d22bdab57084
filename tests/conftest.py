"""Shared pytest setup: markers for GPU / SGLang tiers, thread limits, process fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import REPO

SGLANG_PYTHON = Path(os.environ.get("HEADRACE_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = _has_cuda()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none on this machine"))
        if "sglang" in item.keywords and not SGLANG_PYTHON.exists():
            if os.environ.get("CI") != "true":
                item.add_marker(pytest.mark.skip(reason=f"SGLang venv missing at {SGLANG_PYTHON}; run `make sglang-venv`"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "sglang" in item.keywords and not SGLANG_PYTHON.exists():
        pytest.fail(f"CI=true but the SGLang venv is missing at {SGLANG_PYTHON} (make sglang-venv)")


@pytest.fixture(autouse=True, scope="session")
def _torch_threads() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
