"""The reference engine attacked: a real ``headrace engine serve`` on loopback, sent every class of
bad input DESIGN.md "Trust" names. Each answer is a 4xx naming the problem, the engine keeps
serving, and nothing changed (weights, weight version). Stopping: SIGTERM ends the engine while a
weight-sync rendezvous to a dead address blocks, or while a long generation runs (generous
deadlines, no speed claims).

Bad-input classes here: oversized body (by Content-Length and chunked), 10^6 prompts, prompts
over --max-batch, prompts x n over --max-batch, huge n, n of the wrong type (string, bool,
fraction), token ids of the wrong type, rid of the wrong type, sampling_params list of the wrong
length, queue overflow (429), weight path with ``..``, absolute path outside, a missing path
outside (same answer as an existing one), symlinked directory escaping, symlinked weight file
escaping, index weight_map with ``../`` and with an absolute file name, NUL in the path, model_path
of the wrong type.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.engine.engine_contract import Background, post, prompt_ids
from tests.procs import Proc, child_env, free_port, headrace_cmd, reference_engine

REFUSED = ("model_path is outside the directories this engine may load weights from "
           "(the model directory and --allowed-weight-dirs)")


@dataclass
class Target:
    url: str
    proc: Proc
    root: Path          # allowed/ and outside/ below it


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from headrace.shared.modelzoo import init_model

    root = tmp_path_factory.mktemp("adv")
    init_model("tiny-qwen2", root / "model")
    init_model("tiny-qwen2", root / "allowed" / "ok", seed=3)
    init_model("tiny-qwen2", root / "outside" / "secret", seed=7)
    return root


@pytest.fixture(scope="module")
def engine(dirs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with reference_engine(dirs / "model", log, "--allowed-weight-dirs", str(dirs / "allowed"), "--max-body-mb", "8",
                          "--max-batch", "64", "--max-queued", "3") as (url, proc):
        yield Target(url, proc, dirs)


def greedy(e: Target, k: int = 0) -> list[int]:
    r = post(e, "/generate", {"input_ids": prompt_ids(k), "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def version(e: Target) -> str:
    return httpx.get(f"{e.url}/get_weight_version", timeout=30).json()["weight_version"]


def message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if "error" in body else body["message"]


# ---- bounded work ----------------------------------------------------------------------------


def test_an_oversized_body_is_413_before_it_is_read(engine: Target) -> None:
    big = b'{"input_ids": [' + b"1," * (5 * 1024 * 1024) + b"1]}"          # ~10 MiB
    r = httpx.post(f"{engine.url}/generate", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "--max-body-mb" in message(r)

    def chunks() -> Iterator[bytes]:                                      # no Content-Length: counted
        yield b'{"input_ids": ['
        for _ in range(10):
            yield b"1," * (512 * 1024)
        yield b"1]}"

    r = httpx.post(f"{engine.url}/generate", content=chunks(), timeout=60)
    assert r.status_code == 413 and "--max-body-mb" in message(r)
    assert len(greedy(engine)) == 4


@pytest.mark.parametrize("body, status, needle", [
    ({"input_ids": [[1]] * 10 ** 6}, 422, "--max-batch 64"),
    ({"input_ids": [[1, 2]] * 65}, 422, "--max-batch 64"),
    ({"input_ids": [[1, 2]] * 8, "sampling_params": {"n": 16}}, 422, "--max-batch 64"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 10 ** 6}}, 422, "sampling_params.n"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 100}}, 422, "--max-batch 64"),
    ({"input_ids": [1, 2], "sampling_params": {"n": "4"}}, 400, "sampling_params.n must be an integer"),
    ({"input_ids": [1, 2], "sampling_params": {"n": True}}, 400, "sampling_params.n must be an integer"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 2.5}}, 400, "sampling_params.n must be an integer"),
    ({"input_ids": [1, True]}, 400, "list of integers"),
    ({"input_ids": [1, "2"]}, 400, "list of integers"),
    ({"input_ids": [1, 2], "rid": 7}, 400, "rid must be"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {}, {}]}, 400, "list of 3"),
    ([1, 2, 3], 400, "JSON object"),
])
def test_bad_generate_is_a_4xx_naming_the_problem(engine: Target, body: Any, status: int, needle: str) -> None:
    r = post(engine, "/generate", body, timeout=120)
    assert r.status_code == status, r.text
    assert needle in message(r), message(r)
    assert len(greedy(engine, 1)) == 4


def test_beyond_max_queued_is_429_with_retry_after(engine: Target) -> None:
    # Deterministic: requests sent while generation is paused in place stay admitted and unanswered,
    # so three of them fill --max-queued 3 (get_server_info's queued_requests says when).
    assert post(engine, "/pause_generation", {"mode": "in_place"}).status_code == 200
    held = [Background(engine, input_ids=prompt_ids(50 + i), rid=f"held-{i}",
                       sampling_params={"max_new_tokens": 2, "ignore_eos": True}) for i in range(3)]
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{engine.url}/get_server_info", timeout=30).json()["queued_requests"] < 3:
            assert time.monotonic() < deadline, "the held requests were not admitted"
            time.sleep(0.1)
        r = post(engine, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 429, r.text
        assert "--max-queued 3" in message(r) and int(r.headers["retry-after"]) >= 1
    finally:
        post(engine, "/continue_generation", {})
    for bg in held:
        assert len(bg.wait(120)["output_ids"]) == 2        # the held requests are answered after the pause
    assert len(greedy(engine, 2)) == 4


# ---- weights from disk: confined --------------------------------------------------------------


def refused_and_unchanged(e: Target, model_path: Any) -> None:
    before, v = greedy(e, 3), version(e)
    r = post(e, "/update_weights_from_disk", {"model_path": model_path, "weight_version": "pwned"})
    assert r.status_code == 403, r.text
    assert r.json() == {"success": False, "message": REFUSED, "num_paused_requests": 0}
    assert greedy(e, 3) == before and version(e) == v == "default"


def test_weight_paths_outside_the_allowed_directories_are_403_without_disclosure(engine: Target) -> None:
    root = engine.root
    refused_and_unchanged(engine, str(root / "allowed" / ".." / "outside" / "secret"))      # ..
    refused_and_unchanged(engine, str(root / "model" / ".." / "outside" / "secret"))
    refused_and_unchanged(engine, str(root / "outside" / "secret"))                         # absolute, exists
    refused_and_unchanged(engine, str(root / "outside" / "nothing-here"))                   # absolute, missing
    refused_and_unchanged(engine, "/etc")
    refused_and_unchanged(engine, "../../../../../../etc")                                  # relative
    refused_and_unchanged(engine, str(root / "allowed") + "\x00/x")                          # NUL
    refused_and_unchanged(engine, str(root / "allowed-sibling"))                              # a prefix is not a parent


def test_symlinks_out_of_an_allowed_directory_are_403(engine: Target) -> None:
    allowed = engine.root / "allowed"
    link = allowed / "link-dir"
    link.symlink_to(engine.root / "outside" / "secret", target_is_directory=True)
    refused_and_unchanged(engine, str(link))
    files = allowed / "link-file"                       # an allowed directory whose weight file links out
    files.mkdir()
    shutil.copy(engine.root / "outside" / "secret" / "config.json", files / "config.json")
    (files / "model.safetensors").symlink_to(engine.root / "outside" / "secret" / "model.safetensors")
    refused_and_unchanged(engine, str(files))


@pytest.mark.parametrize("escape", ["../../outside/secret/model.safetensors", "ABS"])
def test_an_index_weight_map_escaping_is_403(engine: Target, escape: str) -> None:
    d = engine.root / "allowed" / f"index-{len(escape)}"
    d.mkdir()
    shutil.copy(engine.root / "outside" / "secret" / "config.json", d / "config.json")
    target = str(engine.root / "outside" / "secret" / "model.safetensors") if escape == "ABS" else escape
    from safetensors import safe_open

    with safe_open(str(engine.root / "outside" / "secret" / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: target for n in names}}))
    refused_and_unchanged(engine, str(d))


def test_bad_weight_bodies_are_400_and_allowed_directories_still_load(engine: Target) -> None:
    for body in ({"model_path": 7}, {"model_path": ["/etc"]}, {}, {"model_path": "x", "weight_version": 3}):
        r = post(engine, "/update_weights_from_disk", body)
        assert r.status_code == 400 and "update_weights_from_disk" in r.json()["message"], r.text
    r = post(engine, "/update_weights_from_disk", {"model_path": str(engine.root / "allowed" / "missing")})
    assert r.status_code == 400 and "missing" in r.json()["message"]               # inside: may say what is wrong
    before = greedy(engine, 4)
    r = post(engine, "/update_weights_from_disk", {"model_path": str(engine.root / "allowed" / "ok"),
                                                   "weight_version": "5"})
    assert r.status_code == 200, r.text
    assert version(engine) == "5" and greedy(engine, 4) != before
    r = post(engine, "/update_weights_from_disk", {"model_path": str(engine.root / "model"),
                                                   "weight_version": "default"})
    assert r.status_code == 200 and greedy(engine, 4) == before


# ---- stopping --------------------------------------------------------------------------------


def exits_after_sigterm(proc: Proc, within_s: float = 15.0) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.popen.wait(within_s)
    except Exception:  # noqa: BLE001
        raise AssertionError(f"the engine did not exit {within_s} s after SIGTERM:\n{proc.log()[-3000:]}") from None


def test_sigterm_ends_an_engine_joining_a_dead_weight_sync_address(dirs: Path, tmp_path: Path) -> None:
    with reference_engine(dirs / "model", tmp_path / "engine.log") as (url, proc):
        dead = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                "group_name": "g", "backend": "gloo"}
        t = threading.Thread(target=lambda: httpx.post(f"{url}/init_weights_update_group", json=dead, timeout=900),
                             daemon=True)
        t.start()
        time.sleep(1.0)                 # let the join start (it then blocks on the dead rendezvous)
        assert proc.alive()
        exits_after_sigterm(proc)


def test_sigterm_ends_an_engine_busy_with_a_long_generate(dirs: Path, tmp_path: Path) -> None:
    with reference_engine(dirs / "model", tmp_path / "engine.log") as (url, proc):
        body = {"input_ids": [prompt_ids(i) for i in range(64)],
                "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}}
        t = threading.Thread(target=lambda: _swallow(lambda: httpx.post(f"{url}/generate", json=body, timeout=900)),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
            if st["running"] >= 1:
                break
            time.sleep(0.2)
        exits_after_sigterm(proc)


def test_an_engine_stops_when_its_parent_is_gone(dirs: Path, tmp_path: Path) -> None:
    """``--parent-pid``: a launcher killed with SIGKILL leaves no engine behind."""
    port = free_port()
    argv = headrace_cmd("engine", "serve", "--model", str(dirs / "model"), "--port", str(port), "--threads", "1")
    pidfile = tmp_path / "engine.pid"
    script = (f"import subprocess, os, time; p = subprocess.Popen({argv!r} + ['--parent-pid', str(os.getpid())], "
              f"start_new_session=True); open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(3600)")
    launcher = Proc([argv[0], "-c", script], tmp_path / "launcher.log", env=child_env(threads=1))
    try:
        launcher.wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
        engine_pid = int(pidfile.read_text())
        launcher.kill9()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _exists(engine_pid):
            time.sleep(0.2)
        assert not _exists(engine_pid), launcher.log()[-3000:]
    finally:
        launcher.stop()
        if pidfile.exists() and _exists(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _swallow(fn: Any) -> None:
    try:
        fn()
    except httpx.HTTPError:
        pass
