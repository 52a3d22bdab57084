"""``shared.serving``'s memory settings, in real child processes (no timing):
- ``keep_freed_memory``: after it, a process that keeps allocating and freeing MB-sized blocks (what
  a service receiving MB bodies does) reuses its heap instead of faulting in fresh pages for every
  block. Counted in minor page faults.
- ``serve`` freezes what was allocated before the server started (out of the cyclic GC's walks),
  while cyclic garbage made later is still collected; ``freeze_heap=False`` leaves the GC alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import httpx
import pytest

from tests.procs import Proc, child_env, free_port

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


_SERVE = """
import gc, sys
from fastapi import FastAPI
from headrace.shared.serving import serve

app = FastAPI()

class Node:
    pass

@app.get("/gc")
def state() -> dict:
    a, b = Node(), Node()   # a cycle made while serving: only the cyclic GC frees it
    a.other, b.other = b, a
    del a, b
    return {"frozen": gc.get_freeze_count(), "collected": gc.collect()}

serve(app, "127.0.0.1", int(sys.argv[1]), freeze_heap=sys.argv[2] == "on")
"""


@pytest.mark.parametrize("freeze", ["on", "off"])
def test_serve_freezes_the_startup_heap_and_still_collects_later_cycles(freeze: str, tmp_path) -> None:
    port = free_port()
    proc = Proc([sys.executable, "-c", _SERVE, str(port), freeze], tmp_path / "serve.log", env=child_env())
    try:
        url = f"http://127.0.0.1:{port}/gc"
        proc.wait_http(url)
        got = httpx.get(url, timeout=10).json()
    finally:
        proc.stop()
    if freeze == "on":   # fastapi, pydantic, uvicorn and the app: far more than this many objects
        assert got["frozen"] > 20_000, got
    else:
        assert got["frozen"] == 0, got
    assert got["collected"] >= 2, f"the cycle made while serving was not collected: {got}"
