"""Token-exact trajectories of an episode: segments, prefix matching, and what each call appends.

Guarantees:
- Generated ids are never re-tokenized: a segment's tokens are the first call's rendered prompt,
  then for each call its completion ids exactly as the engine produced them (loss_mask 1, the
  engine's logprobs), and between calls only the tokenization of the *new* text (loss_mask 0,
  logprob 0.0).
- A chat call continues the current segment when its messages are the previous call's messages
  followed by the assistant message the gateway returned (compared as messages: role, content, tool
  calls, tool_call_id), the tools are the same, and the template renders the longer conversation as
  an extension of the shorter one. The new text is then what closes the assistant turn where the
  completion did not (e.g. ``\\n`` after a generated ``<|im_end|>``), the new messages, and the
  next assistant header. Anything else starts a new segment (a prefix break).
- A completion call continues the segment when its prompt extends the segment: by token ids for an
  id prompt, by text (the segment decoded) for a text prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from headrace.rollout.generate import STATUS
from headrace.shared.schemas import Sample

_SENTINEL = "\x00HEADRACE-TURN\x00"


def decode(tok: Any, ids: list[int], skip_special_tokens: bool) -> str:
    """``tok.decode(ids, skip_special_tokens=...)``, the same text. A fast tokenizer that does not
    clean up tokenization spaces decodes with its Rust backend alone, which is all transformers'
    ``decode`` then does, after converting its input and resolving its options (most of the CPU)."""
    backend = getattr(tok, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and getattr(tok, "clean_up_tokenization_spaces", True) is False:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass
class Segment:
    """One trajectory: its own sample of the episode's group."""

    tokens: list[int]
    prompt_length: int
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_version: int | None = None
    finish: str = "stop"                      # engine finish of the last call: stop | length | abort
    kind: str = "chat"                        # chat | completion
    history: list[dict[str, Any]] = field(default_factory=list)   # template messages incl. the answer
    history_key: list[Any] = field(default_factory=list)          # normalized(history)
    tools: list[dict[str, Any]] | None = None
    rendered: str | None = None           # the last chat call's prompt as rendered: render(history[:-1], gen.)
    last_ids: list[int] = field(default_factory=list)             # the last completion's ids
    calls: int = 0

    def add_context(self, ids: list[int]) -> None:
        """Template / tool / user tokens: part of the response, not trained on."""
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_completion(self, ids: list[int], logprobs: list[float], version: int | None, finish: str) -> None:
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [min(0.0, float(x)) for x in logprobs]
        self.last_ids = list(ids)
        self.finish = finish
        self.calls += 1
        if ids and version is not None:
            self.weight_version = version if self.weight_version is None else min(self.weight_version, version)

    def view(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "prompt_length": self.prompt_length, "loss_mask": self.loss_mask,
                "rollout_logprobs": self.logprobs, "weight_version": self.weight_version}

    def sample(self, uid: str, group_id: str, index: int, version: int, tokenizer: Any, **fields: Any) -> Sample:
        """The segment as a Sample with no reward yet (``model_construct``: the caller validates it
        once the reward is set)."""
        response = self.tokens[self.prompt_length:]
        return Sample.model_construct(
            uid=uid, group_id=group_id, index=index, tokens=list(self.tokens), response_length=len(response),
            loss_mask=list(self.loss_mask), rollout_logprobs=list(self.logprobs), reward=None,
            status=STATUS.get(self.finish, "completed"),
            weight_version=self.weight_version if self.weight_version is not None else version,
            prompt=decode(tokenizer, self.tokens[: self.prompt_length], False),
            response=decode(tokenizer, response, True), **fields)


class _Lru:
    """A small least-recently-used map (renders and encodings shared by episodes)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.data: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any) -> Any:
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        self.data[key] = value
        if len(self.data) > self.size:
            self.data.popitem(last=False)


class Recorder:
    """Renders and tokenizes with one tokenizer; decides continue-or-break for each call.

    Renders and encodings are cached (``CACHE_ENTRIES`` each, texts up to ``CACHE_CHARS``): the n
    episodes of a prompt send the same first request, and the template is a pure function of the
    messages and tools (a template that reads the clock, ``strftime_now``, is never cached). The
    cache returns what the template and tokenizer would: a render is keyed by the exact JSON of
    messages, tools and the generation flag, an encoding by its text; ids are handed out as copies."""

    CACHE_ENTRIES = 256
    CACHE_CHARS = 32_768

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._turn_end: str | None = None
        template = getattr(tokenizer, "chat_template", None)
        self._cache_renders = not (isinstance(template, str) and "strftime_now" in template)
        self._renders = _Lru(self.CACHE_ENTRIES)
        self._encodings = _Lru(self.CACHE_ENTRIES)

    def encode(self, text: str) -> list[int]:
        """``tokenizer(text, add_special_tokens=False)["input_ids"]``, the same ids. A fast tokenizer's
        Rust backend is called directly when it is in the state that call would put it in (no
        truncation, no padding, special tokens not split): transformers' own call batches one text
        through ``encode_batch`` (rayon's worker threads) and converts the result, ~3x the CPU of the
        encoding itself on every gateway call."""
        if not text:
            return []
        cached = self._encodings.get(text)
        if cached is not None:
            return list(cached)
        backend = getattr(self.tok, "_tokenizer", None)
        if (backend is not None and hasattr(backend, "encode") and backend.truncation is None
                and backend.padding is None
                and backend.encode_special_tokens == bool(getattr(self.tok, "split_special_tokens", False))):
            ids = backend.encode(text, add_special_tokens=False).ids
        else:
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        if len(text) <= self.CACHE_CHARS:
            self._encodings.put(text, tuple(ids))
        return ids

    def render(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        key = None
        if self._cache_renders:
            try:
                key = orjson.dumps([msgs, tools or None, generation])
            except TypeError:         # not JSON (e.g. an integer past 64 bits): rendered, not cached
                key = None
            if key is not None and len(key) > self.CACHE_CHARS:
                key = None
            text = self._renders.get(key) if key is not None else None
            if text is not None:
                return text
        text = self.tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=generation, tokenize=False)
        if key is not None:
            self._renders.put(key, text)
        return text

    @property
    def turn_end(self) -> str:
        """What the template writes after an assistant message's content (``<|im_end|>\\n`` for ChatML)."""
        if self._turn_end is None:
            text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}],
                               None, False)
            self._turn_end = text.split(_SENTINEL, 1)[1] if _SENTINEL in text else ""
        return self._turn_end

    def chat(self, seg: Segment | None, msgs: list[dict[str, Any]], key: list[Any],
             tools: list[dict[str, Any]] | None) -> "Plan":
        """How a chat call with ``msgs`` extends ``seg`` (the episode's current segment), or breaks it."""
        full: str | None = None
        if seg is not None and seg.kind == "chat" and seg.tools == tools and key[: len(seg.history_key)] == seg.history_key:
            done = self.render(seg.history, tools, False)
            full = self.render(msgs, tools, True)
            if full.startswith(done):
                return Plan(seg, self.encode(self._close_turn(seg, done) + full[len(done):]), rendered=full)
        full = full if full is not None else self.render(msgs, tools, True)
        ids = self.encode(full)
        return Plan(Segment(tokens=ids, prompt_length=len(ids), kind="chat", tools=tools), [], seg is not None,
                    rendered=full)

    def _close_turn(self, seg: Segment, done: str) -> str:
        """The rest of the assistant turn that the completion's own tokens did not write."""
        # the previous call's rendered prompt (history[:-1] are its messages): not rendered again
        before = seg.rendered if seg.rendered is not None else self.render(seg.history[:-1], seg.tools, True)
        generated = decode(self.tok, seg.last_ids, False)
        if done.startswith(before) and done[len(before):].startswith(generated):
            return done[len(before) + len(generated):]
        end = self.turn_end
        for j in range(len(end), 0, -1):  # the completion ended with part of the turn's end (a stop token)
            if generated.endswith(end[:j]):
                return end[j:]
        return end

    def completion(self, seg: Segment | None, prompt: str | list[int]) -> "Plan":
        """How a completion call with ``prompt`` extends ``seg``, or breaks it."""
        if seg is not None and seg.kind == "completion":
            if isinstance(prompt, list) and prompt[: len(seg.tokens)] == seg.tokens:
                return Plan(seg, list(prompt[len(seg.tokens):]))
            if isinstance(prompt, str):
                have = decode(self.tok, seg.tokens, False)
                if prompt.startswith(have):
                    return Plan(seg, self.encode(prompt[len(have):]))
        ids = list(prompt) if isinstance(prompt, list) else self.encode(prompt)
        return Plan(Segment(tokens=ids, prompt_length=len(ids), kind="completion"), [], seg is not None)


@dataclass
class Plan:
    """A call's effect on the recording, applied only once the engine answered (``commit``): a
    failed or refused call leaves the episode exactly as it was."""

    segment: Segment
    context: list[int]            # ids appended before the completion (loss_mask 0)
    broke: bool = False           # a new segment replaces a current one that could not be continued
    rendered: str | None = None   # a chat call's rendered prompt (kept on the segment once committed)

    @property
    def is_new(self) -> bool:
        return self.segment.calls == 0

    @property
    def input_ids(self) -> list[int]:
        return self.segment.tokens + self.context

    def commit(self, ids: list[int], logprobs: list[float], version: int | None, finish: str) -> None:
        self.segment.add_context(self.context)
        self.segment.add_completion(ids, logprobs, version, finish)
        self.segment.rendered = self.rendered
