"""``shared.serving.keep_freed_memory``: after it, a process that keeps allocating and freeing
MB-sized blocks (what a service receiving MB bodies does) reuses its heap instead of faulting in
fresh pages for every block. Counted in minor page faults of a real child process (no timing)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from tests.procs import child_env

_CHURN = """
import resource, sys
from headrace.shared.serving import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory() is True
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):                    # warm: the heap has grown to its working size
    blocks = [bytearray(1 << 20) for _ in range(8)]
    del blocks
before = faults()
for _ in range(20):                   # 8 x 1 MiB bodies alive at once, then freed
    blocks = [bytearray(1 << 20) for _ in range(8)]
    del blocks
print(faults() - before)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc",
                           reason="keep_freed_memory tunes glibc's malloc; elsewhere it is a no-op")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], env=child_env(), capture_output=True,
                         text=True, timeout=120, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@glibc
def test_freed_blocks_are_reused_instead_of_faulted_in_again() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    # glibc's default gives the freed MBs back to the kernel: every round faults them in again
    # (20 rounds x 8 MiB = 40,960 pages); tuned, the heap keeps them
    assert default > 20_000, f"the default allocator no longer returns freed MBs ({default} faults): the test proves nothing"
    assert tuned < 1_000, f"{tuned} minor faults with the freed memory kept"


def test_no_glibc_means_no_change(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from headrace.shared import serving

    def no_libc(*_: object, **__: object) -> None:
        raise OSError("no libc here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert serving.keep_freed_memory() is False
