"""The shared engine contract (tests/engine/engine_contract.py) against a real SGLang 0.5.23 server on CPU.

The same cases run against the reference engine in tests/engine/test_engine_reference.py; here
``engine`` is a real ``python -m sglang.launch_server`` process from the SGLang venv
(``make sglang-venv``), launched with the CPU flags and ``--dtype float32`` so logprobs compare
with ``transformers``. One server per module, stopped by pid at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.engine.engine_contract import EngineContract
from tests.sglang.sglang_cpu.server import SGLangServer, tiny_model

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@dataclass
class SGLangEngine:
    url: str
    model_dir: Path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    root = tmp_path_factory.mktemp("sglang_contract")
    model_dir = tiny_model(root / "model")
    server = SGLangServer(model_dir, root / "sglang.log").start()
    try:
        yield SGLangEngine(server.url, model_dir)
    finally:
        server.stop()


class TestEngineContract(EngineContract):
    """The shared SGLang contract, against this module's real SGLang server."""

    ABORT_REACHES_HELD_REQUESTS = False   # held in the tokenizer manager (see EngineContract)
