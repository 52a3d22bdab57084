"""Shared pytest setup: markers for GPU / SGLang tiers, thread limits, and the fixtures tests in
several folders use (``tiny_model``). A folder's own fixtures are in its conftest.py; plain helpers in
tests/procs.py and each folder's support.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import SGLANG_PYTHON, VLLM_PYTHON


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Modules that each take minutes (real SGLang / vLLM servers, the four-service fault test) run first:
# with ``-n 2 --dist loadfile`` workers take files in collection order, so starting the longest ones
# early keeps them from stretching the end of the run. The order within each part is unchanged.
LONG_FIRST = ("tests/vllm/", "tests/sglang/", "tests/deploy/test_faults.py")


def _long_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return next((i for i, p in enumerate(LONG_FIRST) if path.startswith(p)), len(LONG_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_long_rank)       # stable
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
        if "vllm" in item.keywords and not VLLM_PYTHON.exists() and os.environ.get("CI") != "true":
            item.add_marker(pytest.mark.skip(reason=f"vLLM venv missing at {VLLM_PYTHON}; run `make vllm-venv`"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "sglang" in item.keywords and not SGLANG_PYTHON.exists():
        pytest.fail(f"CI=true but the SGLang venv is missing at {SGLANG_PYTHON} (make sglang-venv)")
    if "vllm" in item.keywords and not VLLM_PYTHON.exists():
        pytest.fail(f"CI=true but the vLLM venv is missing at {VLLM_PYTHON} (make vllm-venv)")


@pytest.fixture(autouse=True, scope="session")
def _torch_threads() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-qwen2 preset (random init), written once per session (rollout and SGLang tests)."""
    from headrace.shared.modelzoo import init_model

    return init_model("tiny-qwen2", tmp_path_factory.mktemp("model") / "tiny-qwen2")
