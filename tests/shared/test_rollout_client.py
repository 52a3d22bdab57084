"""The rollout client is what light tools import: it must not pull in torch."""

from __future__ import annotations

import subprocess
import sys


def test_rollout_client_does_not_import_torch() -> None:
    code = ("import sys\n"
            "import headrace.shared.rollout_client\n"
            "from headrace.shared.weight_sync import EngineTarget, WeightSyncError, engines_from_rollout\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
