"""A ReAct agent with a calculator tool, written against the plain OpenAI SDK.

Nothing in ``agent`` knows about Headrace: it gets an ``openai.AsyncOpenAI`` client (``ctx.client``)
and a task, talks to the model with tool calling, runs the tools it asks for, and returns a reward.
Trained unchanged by pointing ``rollout.agent`` at it (examples/configs/agent_calculator.yaml); the
rollout service's agent gateway records every completion token for token.

The same function runs against any OpenAI-compatible server, e.g.::

    client = openai.AsyncOpenAI(base_url="http://localhost:8000/v1", api_key="...")
    await agent(SimpleNamespace(client=client), {"prompt": "What is 3 + 4?", "label": "7"})
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

MAX_TURNS = 3
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The tool: a safe arithmetic evaluator (no names, no calls), errors as text for the model."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / ( )")
    try:
        value = ev(ast.parse(str(expression)[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def answer_of(text: str | None) -> str:
    """The final answer: the first number in the model's last message ("" if none)."""
    m = re.search(r"-?\d+(?:\.\d+)?", text or "")
    return m.group(0) if m else ""


async def agent(ctx: Any, task: dict[str, Any]) -> float:
    """Solve ``task["prompt"]`` with the calculator; reward 1.0 when the final answer equals the label."""
    client = ctx.client
    model = (await client.models.list()).data[0].id
    messages: list[Any] = task.get("messages") or [{"role": "user", "content": task["prompt"]}]
    message = None
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(expression)})
    label = task.get("label")
    want = str(label["answer"] if isinstance(label, dict) else label).strip()
    return 1.0 if message is not None and answer_of(message.content) == want else 0.0
