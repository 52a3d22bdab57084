"""One OpenAI call of an episode: sampling values, the engine call, recording, the answer.

Guarantees:
- Omitted sampling values come from ``rollout.sampling``; temperature 0 is greedy; ``seed`` is
  SGLang's ``sampling_seed``; ``max_tokens`` / ``max_completion_tokens`` bound the completion;
  ``stop`` strings end it (the stop string is not part of the returned text).
- A call is recorded only once the engine answered: a refused request (4xx), a call that timed out
  (``rollout.gateway.call_timeout_s``, 503) or an engine failure (502) leaves the episode as it was,
  and usable.
- During a pause or weight sync the call waits (``EngineClient``: gate, partial-rollout resume); the
  segment's weight_version is the oldest version that produced any of its completion tokens.
- ``usage.prompt_tokens`` is what was sent to the engine for this call (the whole trajectory so
  far), ``completion_tokens`` the generated ids (a generated stop token included), with one
  ``logprobs.content`` entry each.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from headrace.rollout.gateway.episodes import Episode, EpisodeStore
from headrace.rollout.gateway.openai_api import (ApiError, ChatRequest, CompletionRequest, chat_completion,
                                                 chat_logprobs, normalized, template_messages, text_completion)
from headrace.rollout.gateway.recording import Plan, Recorder, decode
from headrace.rollout.gateway.toolcalls import parser_for
from headrace.rollout.generate import EngineClient, EngineError
from headrace.shared.config import RolloutConfig


class Calls:
    """Serves chat and text completions for episodes of ``store``."""

    def __init__(self, rc: RolloutConfig, engine: EngineClient, tokenizer: Any, store: EpisodeStore,
                 model_name: str) -> None:
        self.rc = rc
        self.engine = engine
        self.tok = tokenizer
        self.store = store
        self.model_name = model_name
        self.recorder = Recorder(tokenizer)
        self.parse_tools = parser_for(tokenizer)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist: this gateway serves `{self.model_name}`",
                           "model", "not_found_error")

    def sampling(self, req: ChatRequest | CompletionRequest, max_tokens: int | None) -> dict[str, Any]:
        p = self.rc.sampling.to_sglang()
        if req.temperature is not None:
            p["temperature"] = req.temperature
        if req.top_p is not None:
            p["top_p"] = req.top_p
        if max_tokens is not None:
            p["max_new_tokens"] = max_tokens
        if req.stop:
            stops = [req.stop] if isinstance(req.stop, str) else req.stop
            if len(stops) > 16 or not all(stops):
                raise ApiError(400, "stop: at most 16 non-empty strings", "stop")
            p["stop"] = stops
        if req.seed is not None:
            p["sampling_seed"] = req.seed
        return p

    async def _generate(self, ep: Episode, plan: Plan, params: dict[str, Any]) -> tuple[list[int], list[float], str, int]:
        """Run the engine for ``plan``; commit it; (ids, logprobs, finish type, prompt tokens)."""
        ids_in = plan.input_ids
        ep.ctx.weight_version = None
        try:
            async with asyncio.timeout(self.rc.gateway.call_timeout_s):   # no extra task, unlike wait_for
                out = await self.engine.generate(ep.ctx, ids_in, params)
        except TimeoutError:
            raise ApiError(503, f"no answer within rollout.gateway.call_timeout_s ({self.rc.gateway.call_timeout_s:g} s); "
                                "the episode is unchanged") from None
        except EngineError as e:
            raise ApiError(502, f"the engine failed: {e}; the episode is unchanged", kind="api_error") from None
        ids = list(out["output_ids"])
        lps = [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]
        finish = out["meta_info"]["finish_reason"]["type"]
        if plan.broke:
            self.store.counts["prefix_breaks"] += 1
        if plan.is_new:
            ep.segments.append(plan.segment)
        plan.commit(ids, lps, ep.ctx.weight_version if ep.ctx.weight_version is not None else self.engine.gate.version,
                    finish)
        ep.calls += 1
        self.store.counts["calls"] += 1
        return ids, lps, finish, len(ids_in)

    def _text(self, ids: list[int], stops: list[str]) -> str:
        text = decode(self.tok, ids, True)
        for s in stops:
            if text.endswith(s):
                return text[: -len(s)]
        return text

    async def chat(self, ep: Episode, req: ChatRequest) -> dict[str, Any]:
        self.check_model(req.model)
        msgs = template_messages(req.messages)
        tools = self._tools(req)
        params = self.sampling(req, req.max_completion_tokens or req.max_tokens)
        async with ep.lock:
            self._usable(ep)
            plan = self.recorder.chat(ep.current, msgs, normalized(msgs), tools)
            ids, lps, finish, n_prompt = await self._generate(ep, plan, params)
            text = self._text(ids, params.get("stop", []))
            content, calls = (text, []) if req.tool_choice == "none" or not tools else self.parse_tools(text)
            answer = chat_completion(self.model_name, content, calls,
                                     "length" if finish == "length" else "tool_calls" if calls else "stop",
                                     n_prompt, len(ids), chat_logprobs(self._pieces(ids), lps) if req.logprobs else None)
            returned = template_messages_of(answer)
            plan.segment.history = msgs + returned
            plan.segment.history_key = normalized(plan.segment.history)
            ep.last_active = time.monotonic()
            return answer

    async def completion(self, ep: Episode, req: CompletionRequest) -> dict[str, Any]:
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (n=1, one trajectory per episode)", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        if isinstance(prompt, list) and any(not 0 <= t < len(self.tok) for t in prompt):
            raise ApiError(400, f"prompt: token ids must be in [0, {len(self.tok)})", "prompt")
        params = self.sampling(req, req.max_tokens or 16)
        async with ep.lock:
            self._usable(ep)
            plan = self.recorder.completion(ep.current, prompt)
            ids, lps, finish, n_prompt = await self._generate(ep, plan, params)
            ep.last_active = time.monotonic()
            return text_completion(self.model_name, self._text(ids, params.get("stop", [])),
                                   "length" if finish == "length" else "stop", n_prompt, len(ids),
                                   self._pieces(ids) if req.logprobs is not None else None, lps)

    def _usable(self, ep: Episode) -> None:
        if ep.state != "open":
            raise ApiError(401, "the episode is finished")
        ep.last_active = time.monotonic()

    def _tools(self, req: ChatRequest) -> list[dict[str, Any]] | None:
        tools = req.tools or None
        for i, t in enumerate(tools or ()):
            f = t.get("function")
            if t.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ApiError(400, f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                               f"tools[{i}]")
        tc = req.tool_choice
        if isinstance(tc, str) and tc not in ("none", "auto", "required"):
            raise ApiError(400, f"tool_choice: {tc!r} is not none, auto, required or a function", "tool_choice")
        if isinstance(tc, dict):
            name = (tc.get("function") or {}).get("name")
            if name not in {t["function"]["name"] for t in tools or ()}:
                raise ApiError(400, f"tool_choice names {name!r}, which is not among tools", "tool_choice")
        return tools

    def _pieces(self, ids: list[int]) -> list[str]:
        return [decode(self.tok, [i], False) for i in ids]


def template_messages_of(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant message of an answer as the chat template (and prefix matching) sees it."""
    msg = answer["choices"][0]["message"]
    d: dict[str, Any] = {"role": "assistant", "content": msg["content"] or ""}
    if msg.get("tool_calls"):
        d["tool_calls"] = [{"id": c["id"], "type": "function",
                            "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                           for c in msg["tool_calls"]]
    return [d]
