"""Helpers for the rollout integration tests (no tests here): prompt files, and a stack of real
processes on loopback — ``headrace buffer serve`` and ``headrace rollout serve``, which itself
launches ``headrace engine serve`` processes. The fixtures over them (``stacks``) are in
tests/rollout/conftest.py; the tiny model (``tiny_model``) in tests/conftest.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml

from headrace.shared.client import BufferClient
from headrace.shared.schemas import Group
from tests.procs import Proc, child_env, free_port, headrace_cmd


def write_prompts(path: Path, n: int, label: Callable[[int], Any] = str) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": label(i)}) + "\n" for i in range(n)))
    return path


def generated(stacks: Callable[..., "Stack"], model: Path, tmp: Path, reward_src: str, groups: int, *, prompts: int,
              n: int, max_new_tokens: int, **rollout: Any) -> tuple["Stack", list[Group]]:
    """A started on_demand stack whose reward is ``reward_src`` (a module defining ``reward``), on
    ``prompts`` prompts labelled ``{"answer": "<i>"}``, ``n`` samples each of ``max_new_tokens``
    tokens (EOS ignored), plus ``rollout`` keys; ``groups`` groups generated (checked) and leased
    back."""
    (tmp / "rw.py").write_text(reward_src)
    s = stacks(model, {
        "data": {"path": str(write_prompts(tmp / "p.jsonl", prompts, lambda i: {"answer": str(i)})), "shuffle": False},
        "n_samples_per_prompt": n, "mode": "on_demand", "reward": f"{tmp}/rw.py:reward",
        "sampling": {"max_new_tokens": max_new_tokens, "ignore_eos": True}, **rollout}).start()
    r = s.post("/v1/generate_batch", {"groups": groups})
    assert r.status_code == 200 and r.json()["groups"] == groups, r.text
    got = s.lease_all()
    assert len(got) == groups
    return s, got


class Stack:
    """A buffer and a rollout service (with its engines) as child processes; ``stop`` ends them by pid."""

    def __init__(self, tmp: Path, model: Path, rollout: dict[str, Any], max_staleness: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = env or {}   # extra environment of the rollout service
        tmp.mkdir(parents=True, exist_ok=True)
        self.buffer_port = free_port()
        self.rollout_port = free_port()
        self.buffer_url = f"http://127.0.0.1:{self.buffer_port}"
        self.url = f"http://127.0.0.1:{self.rollout_port}"
        rollout = {"state_path": str(tmp / "rollout_state.json"), **rollout}
        rollout.setdefault("engines", {"backend": "reference", "count": 1})
        if rollout["engines"].get("backend", "reference") != "external":   # this worker's ports, not 30000 + i
            rollout["engines"] = {"base_port": free_port(), **rollout["engines"]}
        self.config = tmp / "run.yaml"
        self.config.write_text(yaml.safe_dump({
            "model": str(model), "buffer": {"url": self.buffer_url, "max_staleness": max_staleness},
            "rollout": rollout, "run": {"out": str(tmp / "run")}}))
        self.buffer: Proc | None = None
        self.rollout: Proc | None = None
        self.starts = 0

    rollout_args: tuple[str, ...] = ()   # extra `headrace rollout serve` flags, e.g. ("--insecure",)

    def start_buffer(self) -> None:
        self.buffer = Proc(headrace_cmd("buffer", "serve", "--port", str(self.buffer_port), "--db",
                                        str(self.tmp / "buffer.sqlite")), self.tmp / "buffer.log")
        self.buffer.wait_http(f"{self.buffer_url}/health", timeout=60)

    def start_rollout(self) -> None:
        self.starts += 1
        self.rollout = Proc(headrace_cmd("rollout", "serve", "--config", str(self.config), "--port",
                                         str(self.rollout_port), *self.rollout_args),
                            self.tmp / f"rollout-{self.starts}.log",
                            env=child_env(HEADRACE_LOG_LEVEL="INFO", **self.env))
        self.rollout.wait_http(f"{self.url}/health", timeout=240)

    def start(self) -> "Stack":
        self.start_buffer()
        self.start_rollout()
        return self

    def get(self, path: str, timeout: float = 30) -> Any:
        r = httpx.get(f"{self.url}{path}", timeout=timeout)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict[str, Any], timeout: float = 300) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)

    def status(self, timeout: float = 30) -> dict[str, Any]:
        return self.get("/v1/status", timeout)

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 180, what: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert self.rollout is not None and self.rollout.alive(), self.rollout.log()[-4000:] if self.rollout else ""
            st = self.status(timeout=120)   # a loaded machine (engines starting) may answer slowly
            if pred(st):
                return st
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last status {json.dumps(st)[:3000]}\n"
                             f"{self.rollout.log()[-3000:] if self.rollout else ''}")

    def buffer_stats(self) -> dict[str, Any]:
        with BufferClient(self.buffer_url) as c:
            return c.stats().model_dump()

    def lease_all(self, token: str | None = None) -> list[Group]:
        """Lease and ack everything queued in the buffer."""
        with BufferClient(self.buffer_url, token=token) as c:
            n = c.stats().queued
            if n == 0:
                return []
            lease = c.lease(n, wait_s=0)
            assert lease is not None
            c.ack(lease.lease_id)
            return lease.groups

    def stop(self) -> None:
        for p in (self.rollout, self.buffer):
            if p is not None:
                p.stop()


def check_groups(groups: list[Group], vocab: int, n: int, tokens: int, version: int = 0, exact: bool = False) -> None:
    """Complete groups of ``n`` samples of ``tokens`` ignore-eos tokens each (truncated), a logprob
    per response token, ids inside the vocabulary, scored, tagged ``version`` (at least it, unless
    ``exact``)."""
    assert groups
    for g in groups:
        assert len(g.samples) == n and sorted(x.index for x in g.samples) == list(range(n))
        for x in g.samples:
            assert x.status == "truncated" and x.response_length == tokens, x
            assert len(x.rollout_logprobs) == len(x.loss_mask) == tokens
            assert all(lp <= 0.0 for lp in x.rollout_logprobs)
            assert all(0 <= t < vocab for t in x.tokens)
            assert (x.weight_version == version if exact else x.weight_version >= version) and x.reward is not None, x
