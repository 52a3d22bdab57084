"""The rollout service end to end on loopback: real buffer, real reference engines, real HTTP.

Covers: a custom generator loaded from a file outside the package (tool tokens with loss_mask 0),
plugins that raise or return the wrong type (failed samples, service keeps running), the built-in
zero-variance filter with over-sampling (on_demand generate_batch), and pause (abort) / resume
with partial rollouts continued under the remaining token budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rollout.support import write_prompts

GENERATOR = '''
from headrace.rollout.generate import append_tokens, append_turn

async def generate(ctx, sample, sampling):
    if sample.index == 1:
        raise RuntimeError("plugin exploded")
    if sample.index == 2:
        return {"not": "a sample"}
    first = await ctx.generate(sample.tokens, dict(sampling, max_new_tokens=3))
    append_turn(sample, first)
    tool = "<r>7</r>"
    append_tokens(sample, ctx.tokenizer(tool, add_special_tokens=False)["input_ids"], tool)
    second = await ctx.generate(sample.tokens, dict(sampling, max_new_tokens=3))
    append_turn(sample, second)
    sample.metadata["turns"] = 2
    return sample
'''


def test_custom_generator_from_a_file_with_tool_masks_and_faulty_plugins(tmp_path: Path, tiny_model, stacks) -> None:
    gen = tmp_path / "outside" / "my_generator.py"
    gen.parent.mkdir()
    gen.write_text(GENERATOR)
    s = stacks(tiny_model, {
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 6)), "shuffle": False},
        "n_samples_per_prompt": 4, "mode": "on_demand", "generate": f"{gen}:generate",
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}}).start()
    assert s.get("/v1/engines") == [{"url": s.status()["engines"][0]["url"], "world_size": 1}]
    r = s.post("/v1/generate_batch", {"groups": 2})
    assert r.status_code == 200 and r.json()["groups"] == 2, r.text
    groups = s.lease_all()
    assert len(groups) == 2
    uids = [x.uid for g in groups for x in g.samples]
    assert len(set(uids)) == 8 and all(u.startswith(g.group_id) for g in groups for u in (x.uid for x in g.samples))
    for g in groups:
        by_index = {x.index: x for x in g.samples}
        good = [by_index[0], by_index[3]]
        for x in good:
            assert x.status == "truncated" and x.weight_version == 0 and x.metadata["turns"] == 2
            assert x.loss_mask[:3] == [1, 1, 1] and x.loss_mask[-3:] == [1, 1, 1]
            tool = x.loss_mask[3:-3]
            assert tool and set(tool) == {0}
            assert len(x.rollout_logprobs) == x.response_length == len(x.loss_mask)
            assert all(lp < 0 for lp, m in zip(x.rollout_logprobs, x.loss_mask) if m == 1)
            assert x.reward in (0.0, 1.0) and "<r>7</r>" in x.response
        assert by_index[1].status == "failed" and by_index[1].reward is None
        assert "plugin exploded" in by_index[1].metadata["error"]
        assert by_index[2].status == "failed" and "must return a Sample" in by_index[2].metadata["error"]
        assert by_index[1].response_length == 0 and by_index[1].tokens == good[0].tokens[:good[0].prompt_length]
    st = s.status()
    assert st["counts"]["samples_failed"] == 4 and st["produced"] == 2
    assert s.post("/v1/generate_batch", {"groups": 1}).json()["groups"] == 1  # still serving


REWARD = '''
def reward(ctx, sample):
    return float(sample.index % 2) if sample.label == "vary" else 0.0
'''


def test_zero_variance_filter_with_over_sampling(tmp_path: Path, tiny_model, stacks) -> None:
    (tmp_path / "rw.py").write_text(REWARD)
    s = stacks(tiny_model, {
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 16, lambda i: "vary" if i % 3 == 0 else "flat")),
                 "shuffle": False, "epochs": 1},
        "n_samples_per_prompt": 2, "mode": "on_demand", "reward": f"{tmp_path}/rw.py:reward",
        "filter": "zero_variance", "sampling": {"max_new_tokens": 2}}).start()
    r = s.post("/v1/generate_batch", {"groups": 3}).json()
    assert r["groups"] == 3 and r["complete"] and r["prompts_drawn"] >= 7  # slots 0, 3, 6 pass; others dropped
    groups = s.lease_all()
    assert len(groups) == 3 and all(sorted(x.reward for x in g.samples) == [0.0, 1.0] for g in groups)
    assert sorted(g.metadata["position"] for g in groups) == [0, 3, 6]
    assert s.status()["counts"]["groups_filtered"] >= 4
    # the data (one epoch) holds only 3 more passing prompts: the batch returns them and says so
    r = s.post("/v1/generate_batch", {"groups": 10}).json()
    assert (r["groups"], r["complete"], r["data_exhausted"]) == (3, False, True)
    assert sorted(g.metadata["position"] for g in s.lease_all()) == [9, 12, 15]


@pytest.mark.parametrize("fast", [False, True], ids=["orjson", "fast-answers"])
def test_pause_abort_keeps_partial_rollouts_and_resume_tags_the_new_version(tmp_path: Path, tiny_model, stacks,
                                                                             fast: bool) -> None:
    # fast: every batch of engine answers, however short, is read by rollout.fast_answers, so the
    # aborted first segments that a resume joins are compact answers (no SGLang entries)
    s = stacks(tiny_model, {
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 64))},
        "n_samples_per_prompt": 2, "groups_per_step": 4, "max_concurrency": 8,
        "sampling": {"max_new_tokens": 48, "ignore_eos": True}}, max_staleness=100,
        env={"HEADRACE_FAST_ANSWERS_MIN_BYTES": "0"} if fast else None).start()
    import time

    # A pause can land before the engine has produced a token for what is in flight (it gathers
    # bursts before a prefill; slow under load): then nothing is partial, so resume and try again.
    # The admission cap ((100 + 1) x 4 groups) leaves room for all 20 tries: at max_staleness 20 a
    # loaded CI run generated its 84 groups' worth before a pause caught partial tokens, and then
    # nothing more was in flight to catch (5 Dec).
    for _ in range(20):
        s.wait(lambda st: st["in_flight"] >= 4 and st["tokens"] > 0, what="generation in flight")
        time.sleep(0.3)
        r = s.post("/v1/pause", {"mode": "abort"})
        assert r.status_code == 200 and r.json()["in_flight"] == 0, r.text
        st = s.status()
        assert st["paused"] and st["in_flight"] == 0 and st["partial"] == r.json()["partial"]
        if r.json()["partial"] > 0:
            break
        s.post("/v1/resume", {"weight_version": 0})
    else:
        raise AssertionError("20 pauses caught no request holding partial tokens")
    held = r.json()["partial"]
    tokens = st["tokens"]
    time.sleep(1.0)
    assert s.status()["tokens"] == tokens  # nothing generated while paused
    produced = s.status()["produced"]
    assert s.post("/v1/resume", {"weight_version": 3}).json()["weight_version"] == 3
    # 8 sequences (4 groups) were in flight at the pause; groups beyond them start under version 3
    s.wait(lambda st: st["produced"] >= produced + 8 and st["partial"] == 0, what="8 groups after resume")
    samples = [x for g in s.lease_all() for x in g.samples]
    assert all(x.response_length == 48 and x.status == "truncated" for x in samples)
    assert all(len(x.rollout_logprobs) == 48 for x in samples)
    assert {x.weight_version for x in samples} <= {0, 3} and any(x.weight_version == 3 for x in samples)
    resumed = [x for x in samples if x.metadata.get("resumed")]
    # every request that held tokens at the pause was continued, and keeps the oldest version
    # that produced a token; a request aborted before its first token is a plain retry, not resumed
    assert len(resumed) >= held and all(x.weight_version == 0 for x in resumed)
    assert (s.status()["compact_answers"] > 0) == fast
    # drain mode: returns when running requests finished
    r = s.post("/v1/pause", {"mode": "drain"})
    assert r.status_code == 200 and s.status()["in_flight"] == 0


def test_reasoning_gym_task_source_reward_and_evaluate(tmp_path: Path, tiny_model, stacks) -> None:
    s = stacks(tiny_model, {
        "data": {"task": "chain_sum", "size": 50, "eval_size": 6,
                 "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
        "n_samples_per_prompt": 3, "mode": "on_demand", "reward": "reasoning_gym_binary",
        "sampling": {"max_new_tokens": 4}}).start()
    r = s.post("/v1/generate_batch", {"groups": 2})
    assert r.status_code == 200 and r.json()["groups"] == 2, (r.status_code, r.text)
    for g in s.lease_all():
        for x in g.samples:
            assert x.label["task"] == "chain_sum" and x.reward in (0.0, 1.0) and x.status != "failed"
    ev = s.post("/v1/evaluate", {"n": 4}).json()
    assert ev["n"] == 4 and 0.0 <= ev["score"] <= 1.0 and ev["failed"] == 0
    # the parts a trainer with several rollout services asks for: prompts 0, 2, 4 and 1, 3 of the first 5
    parts = [s.post("/v1/evaluate", {"n": 5, "part": [i, 2]}).json() for i in (0, 1)]
    assert [p["n"] for p in parts] == [3, 2] and all(0.0 <= p["score"] <= 1.0 for p in parts)
    assert s.post("/v1/evaluate", {"n": 1, "part": [1, 2]}).json()["n"] == 0   # a part with no prompt
    assert s.buffer_stats()["queued"] == 0  # evaluation pushes nothing


def test_an_on_demand_rounds_groups_reach_the_buffer_in_one_post_once_the_last_is_built(
        tmp_path: Path, tiny_model, stacks) -> None:
    """The loop holds its built groups while others are in production and flushes the pusher when
    none is left (rollout/pusher.py): one POST for the round, written at once."""
    s = stacks(tiny_model, {
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 40)), "shuffle": False},
        "n_samples_per_prompt": 2, "mode": "on_demand", "sampling": {"max_new_tokens": 4}}).start()
    for k in (1, 2):
        r = s.post("/v1/generate_batch", {"groups": 6}).json()
        assert r["groups"] == 6 and r["complete"]
        status = s.status()
        push = status["push"]
        assert (push["posts"], push["eager_posts"], push["accepted"], push["pending"]) == (k, k, 6 * k, 0)
        # the second round's prompt ids were made while the first round's requests were out
        assert status["counts"]["prompts_ahead"] == 6 * (k - 1)
    groups = s.lease_all()
    assert len(groups) == 12
    from headrace.rollout.service import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    for g in groups:   # made ahead or not, each sample starts with its prompt's own ids
        for x in g.samples:
            assert x.tokens[: x.prompt_length] == tok(x.prompt)["input_ids"] and x.prompt_length > 0


def test_continuous_admission_keeps_queued_plus_in_flight_within_the_staleness_window(
        tmp_path: Path, tiny_model, stacks) -> None:
    s = stacks(tiny_model, {
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 100))},
        "n_samples_per_prompt": 2, "groups_per_step": 2, "stats_interval_s": 0.2,
        "sampling": {"max_new_tokens": 4}}, max_staleness=1).start()
    cap = (1 + 1) * 2
    s.wait(lambda st: st["produced"] >= cap, what="the window filled")
    import time

    for _ in range(10):  # it stays full and stops there
        st = s.status()
        b = s.buffer_stats()
        assert b["queued"] + b["leased"] + st["groups_in_flight"] <= cap
        time.sleep(0.2)
    assert st["produced"] == cap and st["admission_cap"] == cap
    from headrace.shared.client import BufferClient

    with BufferClient(s.buffer_url) as c:  # the trainer takes one step: the window reopens by 2
        lease = c.lease(2, wait_s=0)
        c.ack(lease.lease_id)
    s.wait(lambda st: st["produced"] == cap + 2, what="two more groups")
    time.sleep(1.0)
    assert s.status()["produced"] == cap + 2


def test_shipped_examples_run_in_the_service(tmp_path: Path, tiny_model, stacks) -> None:
    """examples/calculator_generator.py and examples/custom_reward.py, loaded from config as users do.
    (A random tiny model rarely writes a tool call; the tool path is covered above and in
    test_plugins_rollout.py — this checks the examples' plumbing against the real engine.)"""
    from tests.procs import REPO

    s = stacks(tiny_model, {
        "data": {"path": str(REPO / "examples" / "data" / "arithmetic.jsonl"), "apply_chat_template": True},
        "n_samples_per_prompt": 2, "mode": "on_demand", "sampling": {"max_new_tokens": 12},
        "generate": f"{REPO}/examples/calculator_generator.py:generate",
        "reward": f"{REPO}/examples/custom_reward.py:reward"}).start()
    r = s.post("/v1/generate_batch", {"groups": 2})
    assert r.status_code == 200 and r.json()["groups"] == 2, (r.status_code, r.text)
    for g in s.lease_all():
        for x in g.samples:
            assert x.status in ("completed", "truncated") and 1 <= x.response_length <= 12
            assert set(x.metadata["rewards"]) == {"correct", "length_penalty"} and x.reward <= 1.0
            assert x.prompt.startswith("<|im_start|>user") and "What is" in x.prompt  # chat template applied


def test_launched_engines_bind_the_configured_host_and_are_listed_under_the_advertised_name(
        tmp_path: Path, tiny_model, stacks) -> None:
    from tests.procs import free_port

    s = stacks(tiny_model, {
        "engines": {"backend": "reference", "count": 1, "base_port": free_port(), "host": "0.0.0.0",
                    "advertise_host": "localhost"},
        "data": {"path": str(write_prompts(tmp_path / "p.jsonl", 4))},
        "n_samples_per_prompt": 2, "mode": "on_demand", "sampling": {"max_new_tokens": 2}})
    s.rollout_args = ("--insecure",)     # engines on 0.0.0.0 without a run token: refused unless asked for
    s.start()
    (engine,) = s.get("/v1/engines")
    assert engine["url"].startswith("http://localhost:")
    pid = s.status()["engines"][0]["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--host") + 1] == b"0.0.0.0"
    assert s.post("/v1/generate_batch", {"groups": 1}).json()["groups"] == 1   # reached by that name


def test_on_demand_batches_take_the_version_the_engines_report(tmp_path: Path, tiny_model, stacks) -> None:
    import httpx

    s = stacks(tiny_model, {"data": {"path": str(write_prompts(tmp_path / "p.jsonl", 8))},
                            "n_samples_per_prompt": 2, "mode": "on_demand", "sampling": {"max_new_tokens": 3}}).start()
    url = s.status()["engines"][0]["url"]
    # what a weight update leaves behind on the engine (SGLang's /update_weight_version)
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": "5"}, timeout=30).status_code == 200
    assert s.post("/v1/generate_batch", {"groups": 1}).json()["groups"] == 1
    assert s.post("/v1/generate_batch", {"groups": 1, "weight_version": 7}).json()["groups"] == 1
    versions = sorted(x.weight_version for g in s.lease_all() for x in g.samples)
    assert versions == [5, 5, 7, 7] and s.status()["weight_version"] == 7
