"""Example generator: multi-turn tool calling with a calculator.

The model may write ``<calc>EXPRESSION</calc>``; generation stops at ``</calc>`` (a stop string),
the expression is evaluated by a safe arithmetic evaluator, and ``<result>VALUE</result>`` is
appended as tool output. Tool tokens are part of the response but get ``loss_mask`` 0 (the policy
did not produce them and must not be trained on them); model tokens get 1. After at most
``MAX_TOOL_CALLS`` calls, or when the model stops without calling the tool, the sample is done.

Use it with ``rollout.generate: examples/calculator_generator.py:generate`` (or the module path
``examples.calculator_generator:generate``). Contract: see rollout/generate.py.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from headrace.rollout.generate import RolloutContext, append_tokens, append_turn
from headrace.shared.schemas import Sample, SampleStatus

MAX_TOOL_CALLS = 4
CALL = re.compile(r"<calc>(.*?)(?:</calc>)?\s*$", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate + - * / // % ** on numbers; anything else is an error string (shown to the model)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def tool_call(text: str) -> str | None:
    """The expression of a calculator call at the end of ``text``, or None."""
    m = CALL.search(text)
    return m.group(1) if m else None


async def generate(ctx: RolloutContext, sample: Sample, sampling: dict[str, Any]) -> Sample:
    budget = int(sampling.get("max_new_tokens", 64))
    stops = list(sampling.get("stop", [])) + ["</calc>"]
    for _ in range(MAX_TOOL_CALLS + 1):
        remaining = budget - sample.response_length
        if remaining <= 0:
            sample.status = SampleStatus.truncated.value
            break
        answer = await ctx.generate(sample.tokens, {**sampling, "stop": stops, "max_new_tokens": remaining})
        append_turn(sample, answer)
        expr = tool_call(answer.get("text") or "")
        if sample.status != SampleStatus.completed.value or expr is None:
            break
        result = f"</calc><result>{calculate(expr)}</result>"
        ids = ctx.tokenizer(result, add_special_tokens=False)["input_ids"]
        append_tokens(sample, ids[:max(0, budget - sample.response_length)], result)
        sample.metadata["tool_calls"] = sample.metadata.get("tool_calls", 0) + 1
    return sample
