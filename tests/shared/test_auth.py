"""The run token on every service (DESIGN.md "Trust: one token, every service").

Real processes on loopback, started with ``HEADRACE_TOKEN`` in their environment: a buffer and a
rollout service (on_demand, so it generates nothing unasked) that launches a reference engine
itself. For each of the three, every route of its FastAPI app's route table (built in-process, not
started, so an endpoint added later is covered without a line here) is sent to the running
process with a missing, wrong, empty and non-Bearer token (401 on each), then with the right one
(anything but 401); ``/health`` stays open. Also: the token is on no command line
(``/proc/<pid>/cmdline``) of any of them, the engine included (the fleet hands it over in the
environment); ``--token`` is refused by every serve command; binding beyond loopback without a
token is refused unless ``--insecure``; the guard's rules (``/metrics``, case of the scheme).
The tiny run with a token set end to end is tests/deploy/test_separate_launch.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from headrace.shared.auth import TOKEN_FLAG_REFUSED, Guard, bind_refusal
from tests.procs import Proc, child_env, free_port, headrace_cmd
from tests.rollout.support import write_prompts

TOKEN = "tok-Zq81-0a9f"
WRONG = {"none": {}, "wrong": {"authorization": "Bearer nope"}, "empty": {"authorization": ""},
         "scheme only": {"authorization": "Bearer"},
         "basic": {"authorization": f"Basic {TOKEN}"}, "bare": {"authorization": TOKEN}}
RIGHT = {"authorization": f"Bearer {TOKEN}"}
OPEN = {"/health", "/metrics"}


class Services:
    """The running buffer, rollout service and its engine, and where they answer."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp, self.model = tmp, model
        self.buffer_url = f"http://127.0.0.1:{free_port()}"
        self.rollout_url = f"http://127.0.0.1:{free_port()}"
        self.config = tmp / "run.yaml"
        self.config.write_text(yaml.safe_dump({
            "model": str(model), "buffer": {"url": self.buffer_url},
            "rollout": {"mode": "on_demand", "state_path": str(tmp / "state.json"),
                        "engines": {"backend": "reference", "count": 1, "base_port": free_port()},
                        "data": {"path": str(write_prompts(tmp / "p.jsonl", 4))}, "n_samples_per_prompt": 2,
                        "sampling": {"max_new_tokens": 4}},
            "run": {"out": str(tmp / "run")}}))
        env = child_env(HEADRACE_TOKEN=TOKEN)
        port = self.buffer_url.rsplit(":", 1)[1]
        self.buffer = Proc(headrace_cmd("buffer", "serve", "--memory", "--port", port), tmp / "buffer.log", env=env)
        self.procs = [self.buffer]
        self.buffer.wait_http(self.buffer_url + "/health", 60)
        port = self.rollout_url.rsplit(":", 1)[1]
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port", port),
                            tmp / "rollout.log", env=env)
        self.procs.append(self.rollout)
        self.rollout.wait_http(self.rollout_url + "/health", 240)
        status = httpx.get(self.rollout_url + "/v1/status", headers=RIGHT, timeout=30).json()
        self.engine_url, self.engine_pid = status["engines"][0]["url"], status["engines"][0]["pid"]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Services]:
    s = Services(tmp_path_factory.mktemp("auth"), tiny_model)
    try:
        yield s
    finally:
        s.stop()


def _routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route of a Starlette/FastAPI app, path parameters filled in."""
    out = []
    for route in app.routes:
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        out += [(m, path) for m in sorted(getattr(route, "methods", None) or {"GET"})]
    assert out, "no routes found"
    return out


def _check_every_route(url: str, routes: list[tuple[str, str]]) -> None:
    routes = routes + [("GET", "/no/such/route")]   # auth comes before routing
    with httpx.Client(base_url=url, timeout=60) as c:
        for method, path in routes:
            if path in OPEN:
                continue
            for case, headers in WRONG.items():
                r = c.request(method, path, headers=headers)
                assert r.status_code == 401, f"{method} {path} with {case} token: {r.status_code} {r.text[:200]}"
                # the agent gateway's OpenAI routes (episode keys) answer in OpenAI's error shape
                detail = (lambda b: b["error"]["message"]) if path.startswith("/openai/") else (lambda b: b["detail"])
                assert r.headers["www-authenticate"] == "Bearer" and (method == "HEAD" or detail(r.json()))
        for method, path in routes:
            if path.startswith("/openai/"):
                continue   # an episode's key, not the run token, opens these (tests/rollout/test_gateway.py)
            try:
                r = c.request(method, path, headers=RIGHT)
            except httpx.TimeoutException:
                continue   # the handler is running: auth let it through (a 401 answers at once)
            assert r.status_code != 401, f"{method} {path} with the right token: {r.status_code} {r.text[:200]}"
        assert c.get("/health").status_code == 200


def test_buffer_every_route(services: Services) -> None:
    from headrace.buffer.app import create_app
    from headrace.shared.config import BufferConfig

    routes = _routes(create_app(BufferConfig(memory=True)).app)
    assert ("POST", "/v1/leases/x/ack") in routes
    _check_every_route(services.buffer_url, routes)
    assert httpx.get(services.buffer_url + "/metrics").status_code == 200   # open unless auth.protect_metrics


def test_rollout_service_every_route(services: Services) -> None:
    from headrace.rollout.service import create_app
    from headrace.shared.config import load_config

    routes = _routes(create_app(load_config(services.config, environ={})))
    assert ("POST", "/v1/resume") in routes and ("POST", "/v1/generate_batch") in routes   # (a plain Starlette route)
    _check_every_route(services.rollout_url, routes)


def test_no_command_line_holds_the_token(services: Services) -> None:
    pids = [p.pid for p in services.procs] + [services.engine_pid]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline, cmdline
    assert b"engine\x00serve" in Path(f"/proc/{services.engine_pid}/cmdline").read_bytes()


def test_engine_launched_by_the_fleet_every_route(services: Services) -> None:
    """Last: the right-token pass pauses the engine and releases its memory; put back afterwards."""
    from headrace.rollout.engine.server import build_app

    routes = _routes(build_app(services.model))
    assert ("POST", "/update_weights_from_disk") in routes and ("POST", "/generate") in routes
    try:
        _check_every_route(services.engine_url, routes)
    finally:
        for path in ("/end_weight_update", "/resume_memory_occupation", "/continue_generation"):
            httpx.post(services.engine_url + path, json={}, headers=RIGHT, timeout=60)


# ---- command lines -----------------------------------------------------------------------------


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(headrace_cmd(*args), capture_output=True, text=True, timeout=120, env=env or child_env())


@pytest.mark.parametrize("command, args", [(("buffer", "serve"), ("--memory",)), (("engine", "serve"), ("--model", "m")),
                                           (("rollout", "serve"), ("--config", "c.yaml")), (("train",), ("--config", "c.yaml"))])
def test_token_flag_is_refused_everywhere(command: tuple[str, ...], args: tuple[str, ...]) -> None:
    p = _run(*command, *args, "--token", TOKEN)
    assert p.returncode == 2 and TOKEN_FLAG_REFUSED in p.stderr, p.stderr
    assert "--token-file" in _run(*command, "--help", env=child_env(COLUMNS="200")).stdout


def test_non_loopback_without_a_token_is_refused(tmp_path: Path) -> None:
    message = bind_refusal("0.0.0.0", None, False)
    assert message and "set HEADRACE_TOKEN or pass --insecure" in message
    conf = tmp_path / "run.yaml"
    conf.write_text("rollout: {engines: {backend: external, urls: ['http://127.0.0.1:9']}}\n")
    for command in (("buffer", "serve", "--memory"), ("engine", "serve", "--model", "m"),
                    ("rollout", "serve", "--config", str(conf))):
        p = _run(*command, "--host", "0.0.0.0")
        assert p.returncode == 2 and message in p.stderr, (command, p.stderr)
    assert bind_refusal("127.0.0.1", None, False) is None and bind_refusal("::1", None, False) is None
    assert bind_refusal("0.0.0.0", TOKEN, False) is None


def test_insecure_allows_a_non_loopback_bind(tmp_path: Path) -> None:
    port = free_port("0.0.0.0")
    env = child_env()
    env.pop("HEADRACE_TOKEN", None)
    proc = Proc(headrace_cmd("buffer", "serve", "--memory", "--host", "0.0.0.0", "--port", str(port), "--insecure"),
                tmp_path / "buffer.log", env=env)
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", 60)
        assert "auth=off" in proc.log()
    finally:
        proc.stop()


def test_token_file_and_retired_key(tmp_path: Path) -> None:
    from headrace.shared.config import ConfigError, load_config, save_config

    f = tmp_path / "token"
    f.write_text(f"  {TOKEN}\n")
    cfg = load_config(overrides={"auth.token_file": str(f)}, environ={})
    assert cfg.auth.token == TOKEN and TOKEN not in repr(cfg)
    saved = save_config(cfg, tmp_path / "config.yaml").read_text()
    assert TOKEN not in saved and yaml.safe_load(saved)["auth"]["token"] == "***"
    assert load_config(tmp_path / "config.yaml", environ={}).auth.token == TOKEN       # its token_file
    bare = tmp_path / "bare.yaml"
    bare.write_text("auth: {token: '***'}\n")
    with pytest.raises(ConfigError, match="HEADRACE_TOKEN"):
        load_config(bare, environ={})                                # "***" alone never means "no token"
    assert load_config(bare, environ={"HEADRACE_TOKEN": TOKEN}).auth.token == TOKEN
    with pytest.raises(ConfigError, match="auth.token.*HEADRACE_TOKEN"):
        load_config(environ={"HEADRACE_BUFFER__TOKEN": TOKEN})
    f.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_config(overrides={"auth.token_file": str(f)}, environ={})


# ---- the guard's rules -------------------------------------------------------------------------


def _scope(path: str, header: bytes | None) -> dict[str, Any]:
    return {"type": "http", "path": path, "headers": [] if header is None else [(b"authorization", header)]}


def test_guard_rules() -> None:
    g = Guard(TOKEN)
    assert g.allows(_scope("/v1/stats", f"Bearer {TOKEN}".encode()))
    assert g.allows(_scope("/v1/stats", f"bearer {TOKEN}".encode()))          # the scheme is case-insensitive
    for header in (None, b"", b"Bearer", b"Bearer ", f"Basic {TOKEN}".encode(), TOKEN.encode(),
                   f"Bearer {TOKEN}x".encode(), f"Bearer  {TOKEN}".encode()):
        assert not g.allows(_scope("/v1/stats", header)), header
    assert g.allows(_scope("/health", None)) and g.allows(_scope("/metrics", None))
    assert not Guard(TOKEN, protect_metrics=True).allows(_scope("/metrics", None))
    assert Guard(None).allows(_scope("/v1/stats", None))


PROBE = '''
import os, subprocess, sys
token = os.environ["HEADRACE_TOKEN"]
print("argv ends with the key:", sys.argv[-2:] == ["--api-key", token], sys.argv[1:-2], flush=True)
print("server_args api_key=" + sys.argv[-1], flush=True)                       # as SGLang logs it
subprocess.run([sys.executable, "-c", "import os; print('child', os.environ['HEADRACE_TOKEN'])"])
'''


def test_module_argv_keeps_the_key_out_of_argv_and_output(tmp_path: Path) -> None:
    """What SGLang and sglang-router are launched with: the key reaches the module's sys.argv only."""
    import sys

    from headrace.shared.auth import module_argv, token_env

    (tmp_path / "probe.py").write_text(PROBE)
    argv = module_argv(sys.executable, "probe", ["--port", "1"], TOKEN)
    assert TOKEN not in " ".join(argv)
    assert module_argv(sys.executable, "probe", ["--port", "1"], None) == [sys.executable, "-m", "probe", "--port", "1"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env=child_env(PYTHONPATH=str(tmp_path), **token_env(TOKEN)))
    assert p.returncode == 0, p.stderr
    assert "argv ends with the key: True ['--port', '1']" in p.stdout
    assert TOKEN not in p.stdout + p.stderr and "api_key=***" in p.stdout and "child ***" in p.stdout
