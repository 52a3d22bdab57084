"""The agent gateway end to end with the official ``openai`` client (sync and async): a real buffer,
rollout service and reference engine on loopback with a run token; one stack for the module (~40 s).

Covered: single-turn chat equals the engine's own tokens and logprobs (greedy), multi-turn
tool-result turns recorded with loss_mask 0, a prefix break (its own sample, counted), streaming,
text completions and models, finish with a reward and through the reward function, grouping of 4
external episodes by group_id, bad requests (OpenAI error shape, episode still usable), keys
(another episode's or a finished one's: 401; management endpoints need the run token), idle
timeout, and a pause + weight-version change in the middle of an episode."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from headrace.shared.modelzoo import load_tokenizer
from tests.rollout.gateway_support import TOKEN, TokenStack, write_tasks

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]
TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenStack]:
    tmp = tmp_path_factory.mktemp("gateway")
    s = TokenStack(tmp / "s", tiny_model, {
        "mode": "on_demand", "data": {"path": str(write_tasks(tmp / "tasks.jsonl", 4))}, "n_samples_per_prompt": 2,
        "groups_per_step": 2, "sampling": {"max_new_tokens": 8}, "reward": "exact_match",
        "gateway": {"episode_timeout_s": TIMEOUT_S}})
    s.start()
    yield s
    s.stop()


def client(ep: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0)


def test_single_turn_matches_the_engine(stack: TokenStack, tiny_model: Path) -> None:
    ep = stack.open_episode()
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    r = client(ep).chat.completions.create(model="tiny-qwen2", messages=msgs, temperature=0, max_tokens=8, logprobs=True)
    seg = stack.get(f"/v1/episodes/{ep['episode_id']}")["segments"][0]
    tok = load_tokenizer(tiny_model)
    prompt = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert seg["tokens"][: seg["prompt_length"]] == prompt and r.usage.prompt_tokens == len(prompt)
    engine = stack.get("/v1/engines")[0]["url"]
    direct = httpx.post(f"{engine}/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).json()
    assert seg["tokens"][len(prompt):] == direct["output_ids"] and r.usage.completion_tokens == len(direct["output_ids"])
    want = [x[0] for x in direct["meta_info"]["output_token_logprobs"]]
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(want, abs=1e-4)
    assert seg["rollout_logprobs"] == pytest.approx(want, abs=1e-4) and seg["loss_mask"] == [1] * len(want)
    assert r.choices[0].finish_reason in ("stop", "length") and r.model == "tiny-qwen2"
    stack.finish(ep["episode_id"], reward=1.0)


def test_multi_turn_tool_results_are_masked(stack: TokenStack, tiny_model: Path) -> None:
    ep = stack.open_episode(group_id="tools-1", label="5", metadata={"task": 7})
    c = client(ep)
    msgs: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]
    answers = []
    for result in ("5", "5", None):
        r = c.chat.completions.create(model="tiny-qwen2", messages=msgs, tools=TOOLS, max_tokens=6, logprobs=True)
        answers.append(r)
        if result is not None:   # the SDK's own message object goes back, as agents do
            msgs += [r.choices[0].message, {"role": "tool", "tool_call_id": f"call_{len(answers)}", "content": result}]
    view = stack.get(f"/v1/episodes/{ep['episode_id']}")
    assert view["calls"] == 3 and len(view["segments"]) == 1
    seg = view["segments"][0]
    stack.finish(ep["episode_id"], reward=0.5)
    (group,) = [g for g in wait_groups(stack, 1) if g.group_id == "tools-1"]
    (s,) = group.samples
    assert s.tokens == seg["tokens"] and s.reward == 0.5 and s.label == "5" and s.metadata["task"] == 7
    # loss mask: 1 exactly on the three completions; their sizes and positions follow from usage
    mask, pos = [], seg["prompt_length"]
    tok = load_tokenizer(tiny_model)
    for i, r in enumerate(answers):
        assert r.usage.prompt_tokens == pos, "each call sends the whole trajectory so far"
        mask += [1] * r.usage.completion_tokens
        lps = [x.logprob for x in r.choices[0].logprobs.content]
        assert s.rollout_logprobs[pos - s.prompt_length: pos - s.prompt_length + len(lps)] == pytest.approx(lps)
        pos += r.usage.completion_tokens
        if i + 1 < len(answers):
            ctx = answers[i + 1].usage.prompt_tokens - pos
            text = tok.decode(s.tokens[pos: pos + ctx])
            assert "<tool_response>\n5\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
            mask += [0] * ctx
            pos += ctx
    assert s.loss_mask == mask and pos == len(s.tokens)


def test_prefix_break_is_its_own_sample(stack: TokenStack) -> None:
    before = stack.status()["prefix_breaks"]
    ep = stack.open_episode(group_id="break-1")
    c = client(ep)
    r = c.chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "What is 1 + 1?"}], max_tokens=4)
    edited = [{"role": "user", "content": "What is 1 + 2?"}, r.choices[0].message, {"role": "user", "content": "Sure?"}]
    c.chat.completions.create(model="tiny-qwen2", messages=edited, max_tokens=4)
    assert len(stack.get(f"/v1/episodes/{ep['episode_id']}")["segments"]) == 2
    assert stack.status()["prefix_breaks"] == before + 1
    stack.finish(ep["episode_id"], reward=1.0)
    (group,) = [g for g in wait_groups(stack, 1) if g.group_id == "break-1"]
    assert len(group.samples) == 2 and len({tuple(s.tokens[: s.prompt_length]) for s in group.samples}) == 1


def test_stream_async_client_completions_and_models(stack: TokenStack) -> None:
    ep = stack.open_episode()

    async def run() -> tuple[str, Any, str]:
        c = openai.AsyncOpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0)
        stream = await c.chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "Hi"}],
                                                 max_completion_tokens=6, stream=True,
                                                 stream_options={"include_usage": True})
        text, usage, finish = "", None, ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        await c.close()
        return text, usage, finish

    text, usage, finish = asyncio.run(run())
    seg = stack.get(f"/v1/episodes/{ep['episode_id']}")["segments"][0]
    assert usage.completion_tokens == len(seg["tokens"]) - seg["prompt_length"] and finish in ("stop", "length")
    models = client(ep).models.list()
    assert [m.id for m in models.data] == ["tiny-qwen2"]
    with pytest.raises(openai.NotFoundError):
        client(ep).models.retrieve("gpt-4o")
    stack.finish(ep["episode_id"], reward=0.0)
    # text completions: token ids, continued by id prefix in one segment
    ep = stack.open_episode()
    c = client(ep)
    r1 = c.completions.create(model="tiny-qwen2", prompt=[1, 376, 259, 201], max_tokens=4, logprobs=0)
    seg = stack.get(f"/v1/episodes/{ep['episode_id']}")["segments"][0]
    assert len(r1.choices[0].logprobs.token_logprobs) == r1.usage.completion_tokens
    c.completions.create(model="tiny-qwen2", prompt=seg["tokens"] + [201], max_tokens=4)
    view = stack.get(f"/v1/episodes/{ep['episode_id']}")
    assert len(view["segments"]) == 1 and view["segments"][0]["loss_mask"][r1.usage.completion_tokens] == 0
    stack.finish(ep["episode_id"], reward=0.0)


def test_bad_requests_leave_the_episode_usable(stack: TokenStack) -> None:
    ep = stack.open_episode()
    c = client(ep)
    user = [{"role": "user", "content": "What is 1 + 1?"}]
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.chat.completions.create(model="tiny-qwen2", messages=user, n=2)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=user)
    with pytest.raises(openai.BadRequestError, match="robot"):
        c.chat.completions.create(model="tiny-qwen2", messages=[{"role": "robot", "content": "x"}])
    bad_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{oops"}}]}
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        c.chat.completions.create(model="tiny-qwen2", messages=user + [bad_call], tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        c.chat.completions.create(model="tiny-qwen2", messages=user, extra_body={"frobnicate": 1})
    r = c.chat.completions.create(model="tiny-qwen2", messages=user, max_tokens=3)
    assert r.choices[0].message.role == "assistant"
    assert stack.get(f"/v1/episodes/{ep['episode_id']}")["calls"] == 1
    # keys: a wrong one, and after finishing; management endpoints need the run token, strictly
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=ep["base_url"], api_key="hr-ep-nope", max_retries=0).models.list()
    other = stack.open_episode()
    stack.finish(ep["episode_id"], reward=1.0)
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model="tiny-qwen2", messages=user, max_tokens=3)
    assert client(other).models.list().data
    assert stack.call("POST", "/v1/episodes", {}, token=None).status_code == 401
    assert stack.call("POST", "/v1/episodes", {}, token=ep["api_key"]).status_code == 401
    for body in ({"group_size": "4"}, {"group_size": 0}, {"colour": 1}, {"group_id": ""}):
        r = stack.call("POST", "/v1/episodes", body)
        assert r.status_code == 422, (body, r.text)
    assert stack.call("POST", f"/v1/episodes/{other['episode_id']}/finish", {"reward": "1"}).status_code == 422
    assert stack.call("POST", "/v1/episodes/ep-unknown/finish", {}).status_code == 404
    assert stack.call("POST", "/v1/episodes", {"group_id": "g-size", "group_size": 2}).status_code == 200
    assert stack.call("POST", "/v1/episodes", {"group_id": "g-size", "group_size": 3}).status_code == 409


def test_reward_function_and_four_episode_group(stack: TokenStack) -> None:
    eps = [stack.open_episode(group_id="ext-4", group_size=4, label="never this") for _ in range(4)]
    for i, ep in enumerate(eps):
        client(ep).chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        stack.finish(ep["episode_id"], reward=None if i % 2 else float(i))
        if i < 3:
            assert stack.get(f"/v1/episodes/{ep['episode_id']}")["state"] == "finished"
    (group,) = [g for g in wait_groups(stack, 1) if g.group_id == "ext-4"]
    assert [s.reward for s in group.samples] == [0.0, 0.0, 2.0, 0.0]   # odd ones: exact_match against the label
    assert [s.index for s in group.samples] == [0, 1, 2, 3] and all(s.label == "never this" for s in group.samples)
    assert stack.call("GET", f"/v1/episodes/{eps[0]['episode_id']}").status_code == 404   # pushed: gone


def test_idle_episode_times_out(stack: TokenStack) -> None:
    ep = stack.open_episode(group_id="idle-1")
    client(ep).chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    deadline = time.monotonic() + 60
    while stack.call("GET", f"/v1/episodes/{ep['episode_id']}").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    gw = stack.status()["gateway"]
    assert gw["episodes_timed_out"] >= 1 and gw["groups_failed"] >= 1
    assert not [g for g in stack.buffer_groups() if g.group_id == "idle-1"], "a group of failed episodes is not pushed"
    with pytest.raises(openai.AuthenticationError):
        client(ep).chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "Hi"}])


def test_pause_and_new_weights_mid_episode(stack: TokenStack) -> None:
    v0 = stack.status()["weight_version"]
    ep = stack.open_episode(group_id="pause-1")
    c = client(ep)
    msgs: list[Any] = [{"role": "user", "content": "What is 1 + 1?"}]
    r = c.chat.completions.create(model="tiny-qwen2", messages=msgs, max_tokens=3)
    msgs += [r.choices[0].message, {"role": "user", "content": "And 2 + 2?"}]
    assert stack.call("POST", "/v1/pause", {"mode": "abort"}).status_code == 200
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(r=c.chat.completions.create(
        model="tiny-qwen2", messages=msgs, max_tokens=3)))
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "a call waits while the service is paused"
    assert stack.call("POST", "/v1/resume", {"weight_version": v0 + 5}).status_code == 200
    t.join(120)
    assert "r" in out
    seg = stack.get(f"/v1/episodes/{ep['episode_id']}")["segments"]
    assert len(seg) == 1 and seg[0]["weight_version"] == v0   # the oldest version that produced a token
    stack.finish(ep["episode_id"], reward=1.0)
    (group,) = [g for g in wait_groups(stack, 1) if g.group_id == "pause-1"]
    assert group.samples[0].weight_version == v0


def wait_groups(stack: TokenStack, n: int, timeout: float = 30.0) -> list[Any]:
    """Lease every group queued in the buffer once at least ``n`` are there (or the time is up)."""
    deadline = time.monotonic() + timeout
    while stack.buffer_stats()["queued"] < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return stack.buffer_groups()


def test_external_agent_drives_an_episode(stack: TokenStack) -> None:
    """The example agent, unchanged, run outside the service: an episode opened over HTTP with the
    run token, driven by its own AsyncOpenAI client, finished with the reward it returned."""
    import importlib.util
    from types import SimpleNamespace

    from tests.procs import REPO

    spec = importlib.util.spec_from_file_location("react_calculator", REPO / "examples" / "agents" / "react_calculator.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ep = stack.open_episode(group_id="external-agent", label="7")

    async def run() -> float:
        c = openai.AsyncOpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0)
        try:
            return await mod.agent(SimpleNamespace(client=c), {"prompt": "What is 3 + 4?", "label": "7"})
        finally:
            await c.close()

    reward = asyncio.run(run())
    assert stack.get(f"/v1/episodes/{ep['episode_id']}")["calls"] >= 1
    stack.finish(ep["episode_id"], reward=reward)
    (group,) = [g for g in wait_groups(stack, 1) if g.group_id == "external-agent"]
    assert group.samples[0].reward == reward and 1 in group.samples[0].loss_mask
