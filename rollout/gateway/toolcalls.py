"""Tool-call parsers: the text a model generates -> OpenAI ``tool_calls``, one parser per chat-template format.

Guarantees:
- ``PARSERS`` is the registry (name -> parser); ``parser_for(tokenizer)`` picks one from the chat
  template's text (a template that mentions ``<tool_call>`` gets ``hermes``, the format of Qwen2 /
  Qwen2.5 / Qwen3 and of the ``tiny-qwen2`` preset); ``register`` adds another.
- A parser returns ``(content, calls)``: ``calls`` empty means the text holds no complete, valid
  tool call, and then ``content`` is the whole text unchanged: a malformed call is returned to the
  agent as plain text (finish_reason ``stop``), never dropped.
- Arguments come back as the JSON text OpenAI's API carries (``json.dumps`` of the parsed value).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text (OpenAI's wire form)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Parser = Callable[[str], tuple[str | None, list[ToolCall]]]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Qwen / Hermes: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks after the content."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments as JSON text already
            try:
                args = json.loads(args)
            except ValueError:
                return text, []
        calls.append(ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[:start].strip()
    return (content or None), calls


def no_tools(text: str) -> tuple[str | None, list[ToolCall]]:
    """For templates without a tool-call format: everything is content."""
    return text, []


PARSERS: dict[str, Parser] = {"hermes": hermes, "none": no_tools}


def register(name: str, parser: Parser) -> None:
    """Add a parser to the registry (a plugin module may call this at import)."""
    PARSERS[name] = parser


def parser_for(tokenizer: Any) -> Parser:
    """The parser of this tokenizer's chat template (``hermes`` when it speaks ``<tool_call>``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    return PARSERS["hermes"] if "<tool_call>" in template else PARSERS["none"]
