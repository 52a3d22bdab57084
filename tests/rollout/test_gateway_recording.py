"""The gateway's recording logic in-process (no engine): tool-call parsing, prefix continuation
with tool calls, a history-rewriting template, the group's common-prompt split and request checks.

The random-init tiny model never emits a tool call by itself, so the completions here are scripted
token ids (the tokenization of what a tool-calling model writes); everything else is real: the
tiny-qwen2 tokenizer and chat template. The engine path is covered by test_gateway.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headrace.rollout.gateway.episodes import group_samples
from headrace.rollout.gateway.openai_api import ApiError, ChatRequest, normalized, parse, template_messages
from headrace.rollout.gateway.recording import Recorder
from headrace.rollout.gateway.toolcalls import hermes, parser_for
from headrace.shared.modelzoo import load_tokenizer
from headrace.shared.schemas import Sample

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(tiny_model: Path):
    return load_tokenizer(tiny_model)


def test_hermes_parser() -> None:
    content, calls = hermes('Let me see.\n<tool_call>\n{"name": "calc", "arguments": {"e": "1+2"}}\n</tool_call>')
    assert content == "Let me see." and [(c.name, json.loads(c.arguments)) for c in calls] == [("calc", {"e": "1+2"})]
    two = hermes('<tool_call>{"name":"a","arguments":{}}</tool_call><tool_call>{"name":"b","arguments":"{\\"x\\": 1}"}</tool_call>')
    assert two[0] is None and [(c.name, c.arguments) for c in two[1]] == [("a", "{}"), ("b", '{"x": 1}')]
    for bad in ['<tool_call>{"name": "calc", "arguments": {</tool_call>', "<tool_call>[1]</tool_call>", "plain text"]:
        assert hermes(bad) == (bad, [])   # malformed: the text comes back as content


def test_tiny_template_speaks_hermes(tok) -> None:
    assert parser_for(tok) is hermes
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert "<tools>" in text and '"name": "calc"' in text and text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _turn(rec: Recorder, seg, msgs, completion_text: str, tools=TOOLS):
    plan = rec.chat(seg, msgs, normalized(msgs), tools)
    ids = rec.encode(completion_text)
    plan.commit(ids, [-0.5] * len(ids), 3, "stop")
    content, calls = hermes(completion_text.removesuffix("<|im_end|>"))
    reply = {"role": "assistant", "content": content or "",
             **({"tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                              "arguments": json.loads(c.arguments)}}
                                for c in calls]} if calls else {})}
    plan.segment.history = msgs + [reply]
    plan.segment.history_key = normalized(plan.segment.history)
    return plan, ids, reply


def test_two_tool_calls_continue_one_segment(tok) -> None:
    rec = Recorder(tok)
    msgs = [{"role": "user", "content": "What is 12 + 30?"}]
    first = '<tool_call>\n{"name": "calc", "arguments": {"e": "12 + 30"}}\n</tool_call><|im_end|>'
    p1, c1, reply = _turn(rec, None, msgs, first)
    seg = p1.segment
    msgs = msgs + [reply, {"role": "tool", "tool_call_id": "x", "content": "42"}]
    p2, c2, reply = _turn(rec, seg, msgs, '<tool_call>\n{"name": "calc", "arguments": {"e": "42"}}\n</tool_call><|im_end|>')
    assert p2.segment is seg and not p2.broke
    ctx2 = p2.context
    msgs = msgs + [reply, {"role": "tool", "tool_call_id": "y", "content": "42"}]
    p3, c3, _ = _turn(rec, seg, msgs, "The answer is 42.<|im_end|>")
    assert p3.segment is seg and not p3.broke
    # the completion produced <|im_end|>: only "\n" closes the turn, then the tool turn and the header
    assert tok.decode(ctx2) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    prompt = rec.encode(rec.render(msgs[:1], TOOLS, True))
    assert seg.tokens == prompt + c1 + ctx2 + c2 + p3.context + c3
    assert seg.loss_mask == [1] * len(c1) + [0] * len(ctx2) + [1] * len(c2) + [0] * len(p3.context) + [1] * len(c3)
    assert seg.prompt_length == len(prompt) and seg.weight_version == 3


def test_edited_history_and_rewriting_template_break(tok, tiny_model: Path) -> None:
    rec = Recorder(tok)
    msgs = [{"role": "user", "content": "What is 1 + 1?"}]
    p1, _, reply = _turn(rec, None, msgs, "2<|im_end|>")
    edited = [{"role": "user", "content": "What is 1 + 2?"}, reply, {"role": "user", "content": "sure?"}]
    p2 = rec.chat(p1.segment, edited, normalized(edited), TOOLS)
    assert p2.broke and p2.segment is not p1.segment and p2.segment.prompt_length == len(p2.input_ids)
    # a template that renders earlier assistant turns differently once the conversation goes on
    rw = load_tokenizer(tiny_model)
    rw.chat_template = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
                        "{%- if m['role'] == 'assistant' and not loop.last %}[elided]{%- else %}{{ m['content'] }}{%- endif %}"
                        "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    p1, _, reply = _turn(Recorder(rw), None, msgs, "2<|im_end|>", tools=None)
    more = msgs + [reply, {"role": "user", "content": "sure?"}]
    assert Recorder(rw).chat(p1.segment, more, normalized(more), None).broke


def test_group_samples_share_the_prompt() -> None:
    a = Sample(uid="a", group_id="g", tokens=[1, 2, 3, 9], response_length=1, loss_mask=[1], rollout_logprobs=[-1.0], reward=1.0)
    b = Sample(uid="b", group_id="g", tokens=[1, 2, 5, 6, 7], response_length=1, loss_mask=[1], rollout_logprobs=[-1.0], reward=0.0)
    out = group_samples("g", [a, b])
    assert [s.uid for s in out] == ["g-0", "g-1"] and all(s.prompt_length == 2 for s in out)
    assert out[1].loss_mask == [0, 0, 1] and out[1].rollout_logprobs == [0.0, 0.0, -1.0]
    for s in out:
        Sample.model_validate(s.model_dump())


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "1"}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_chat_requests(body, param) -> None:
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_bad_messages() -> None:
    req = parse(ChatRequest, json.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).encode())
    with pytest.raises(ApiError, match="robot"):
        template_messages(req.messages)
    bad_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{not json"}}]}
    req = parse(ChatRequest, json.dumps({"model": "m", "messages": [bad_call]}).encode())
    with pytest.raises(ApiError, match="not valid JSON"):
        template_messages(req.messages)


def test_encode_and_render_caches_answer_what_the_tokenizer_does(tok) -> None:
    rec = Recorder(tok)
    texts = ["<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n", " héllo 世界\n\n",
             '<tool_call>\n{"name": "calc", "arguments": {"e": "1+2"}}\n</tool_call>', "x" * 40_000]
    for t in texts * 2:            # the second pass is served from the cache (the long text is not cached)
        ids = rec.encode(t)
        assert ids == list(tok(t, add_special_tokens=False)["input_ids"])
        ids.append(-1)             # the caller owns its list: the cache is not changed through it
    assert rec.encode(texts[0]) == list(tok(texts[0], add_special_tokens=False)["input_ids"])
    tok("a b c d e f", truncation=True, max_length=2)   # leaves the fast backend truncating ...
    try:
        assert rec.encode("a b c d e f") == list(tok("a b c d e f", add_special_tokens=False)["input_ids"])
    finally:
        tok("reset")                                  # ... until transformers' next plain call resets it
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        for gen in (True, False):
            for _ in range(2):
                assert rec.render(msgs, tools, gen) == tok.apply_chat_template(
                    msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
    big = [{"role": "user", "content": "n", "name": 2**70}]   # not JSON for the cache key: rendered anyway
    assert rec.render(big, None, True) == tok.apply_chat_template(big, add_generation_prompt=True, tokenize=False)


def test_a_clock_reading_template_is_never_cached(tok) -> None:
    rec = Recorder(tok)
    assert rec._cache_renders
    tok2 = type("T", (), {"chat_template": "{{ strftime_now('%d %b %Y') }}"})()
    assert not Recorder(tok2)._cache_renders
