"""The ``math_tool`` task as an agent: the policy may call a calculator, in OpenAI's ``tools``
format (``agent``: chat templates that support tools, Qwen2.5, Qwen3, Llama 3.1+) or as
``<calc>expr</calc>`` in its text (``calc_agent``: any template); the agent evaluates each call,
sends the result back, and grades the final answer (its ``\\boxed{}``, else its last number)
against ``sample.answer``.

Written with the ``openai`` client alone, no rlcore import: the same function runs against any
OpenAI-compatible server, and rlcore trains it through its endpoint with
``env: {name: agent, agent: {function: examples/agents/math_tool_agent.py:agent}}``.
"""

import ast
import json
import operator
import re

MAX_TURNS = 4
CALC = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Arithmetic only (never ``eval``); an error is text for the model, never an exception."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("only numbers, + - * / ** and parentheses are allowed")

    try:
        value = walk(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def grade(text: str, answer) -> bool:
    found = BOXED.findall(text) or NUMBER.findall(text)
    try:
        return bool(found) and abs(float(found[-1].strip()) - float(answer)) < 1e-6
    except ValueError:
        return False


async def agent(client, sample):
    """The calculator as an OpenAI tool (templates with tool support; others answer 400)."""
    return await _solve(client, sample, tools=True)


async def calc_agent(client, sample):
    """The calculator as ``<calc>expr</calc>`` in the text: any chat template."""
    return await _solve(client, sample, tools=False)


async def _solve(client, sample, tools: bool):
    messages = list(sample.prompt) if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    options = {"tools": TOOLS} if tools else {"stop": ["</calc>"]}
    calls = 0
    for turn in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, **options)
        message = reply.choices[0].message
        content = message.content or ""
        if message.tool_calls:  # OpenAI tools format
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments or "{}").get("expression", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
            calls += len(message.tool_calls)
            continue
        expressions = [] if tools else CALC.findall(content)
        if expressions and turn < MAX_TURNS - 1:  # the calculator in the text
            messages.append({"role": "assistant", "content": content})
            messages.append({"role": "user", "content": "\n".join(f"<result>{calculate(e)}</result>" for e in expressions)})
            calls += len(expressions)
            continue
        correct = grade(CALC.sub("", content), sample.answer)
        return {"reward": float(correct), "metrics": {"correct": float(correct), "tool_calls": float(calls), "turns": turn + 1.0}}
    return {"reward": 0.0, "metrics": {"correct": 0.0, "tool_calls": float(calls), "turns": float(MAX_TURNS)}}
