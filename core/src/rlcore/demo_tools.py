"""``python -m rlcore.demo --tools``: the CPU demo's policy trained, as an agent, to call a calculator tool.

The agent is ``examples/agents/math_tool_agent.py:agent`` (the ``openai`` client alone): it sends
the problem with ``tools=[calc]``, runs every returned tool call, sends the result back as a
``tool`` message and is graded on its final answer. GRPO trains it through rlcore's endpoint
(``recipes/grpo_agent_tool_arith_tiny_cpu.yaml``).

The model is the demo's SFT warm start (2-digit addition, answered directly) given the tiny
tokenizer's tools-aware chat template (:data:`rlcore.testing.tiny.TOOL_CHAT_TEMPLATE`: OpenAI
``tools`` rendered, Qwen-style ``<tool_call>`` blocks parsed by the endpoint), then a short SFT on
conversations from the training split: one in ``tool_every`` calls the tool and answers with its
result, the others answer directly; only the model's turns are trained. GRPO rewards the right
final answer alone, so calling the tool pays only where the warm start copies the expression into
its call correctly (the agents guide gives the measured run).
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any, Sequence

TOOL_RECIPE = (Path(__file__).resolve().parent / "recipes" / "grpo_agent_tool_arith_tiny_cpu.yaml").resolve()


def conversation_batch(conversations: Sequence[list[dict]], tokenizer: Any, tools: list[dict] | None = None):
    """Each conversation's ids as the chat template renders it (with ``tools``), trained on the
    assistant turns only (their end of turn included): the tokens the model writes at rollout,
    the rest (prompt, tool results, generation prompts) masked."""
    import torch

    from rlcore.interfaces import SequenceBatch

    ids, masks = [], []
    for messages in conversations:
        seq, mask, done = [], [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = _render(tokenizer, messages[:i], tools, generation_prompt=True)
            after = _render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
            if not (before.startswith(done) and after.startswith(before)):
                raise ValueError(f"the chat template does not render conversation {len(ids)} turn by turn "
                                 f"(message {i} changes what came before it): it cannot be trained turn by turn")
            for text, trained in ((before[len(done):], 0.0), (after[len(before):], 1.0)):
                piece = tokenizer.encode(text, add_special_tokens=False) if text else []
                seq += piece
                mask += [trained] * len(piece)
            done = after
        ids.append(torch.tensor(seq))
        masks.append(torch.tensor(mask))
    return SequenceBatch(input_ids=ids, loss_mask=masks)


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def tool_conversation(sample, tool: dict, use_tool: bool) -> list[dict]:
    """A training problem solved directly, or with one call of ``tool`` (its first required
    argument the problem's expression) whose result is the answer."""
    messages = list(sample.prompt)
    if not use_tool:
        return [*messages, {"role": "assistant", "content": str(sample.answer)}]
    argument = tool["parameters"]["required"][0]
    call = {"id": "call-0", "type": "function",
            "function": {"name": tool["name"], "arguments": {argument: sample.metadata["expr"]}}}
    return [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call-0", "content": str(sample.answer)},
            {"role": "assistant", "content": str(sample.answer)}]


def agent_tools(recipe) -> list[dict]:
    """The ``TOOLS`` of the module that defines the recipe's agent (``env.agent.function``)."""
    from rlcore.agents.runner import resolve_agent

    module = inspect.getmodule(resolve_agent(recipe.section("env.agent").function))
    tools = getattr(module, "TOOLS", None)
    if not tools:
        raise SystemExit(f"env.agent.function: the module of {recipe.section('env.agent').function!r} has no TOOLS "
                         "list (OpenAI tools format) to train the warm start's calls on")
    return tools


def tool_warm_start(sft_dir: Path, out_dir: Path, recipe, config, steps: int, batch_size: int, tool_every: int) -> dict:
    """The demo's SFT warm start (``sft_dir``) with the tools-aware tiny tokenizer, trained for
    ``steps`` on conversations of the recipe's training split (one in ``tool_every`` with a tool
    call), exported to ``out_dir``; ``config`` is the SFT run's (``rlcore.demo.sft_config`` of the
    recipe, from ``sft_dir``)."""
    from rlcore.controller.heartbeat import heartbeat
    from rlcore.controller.workers import LocalTrainer
    from rlcore.interfaces import Placement
    from rlcore.plugins import get_plugin_manager
    from rlcore.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer(tools=True)
    tools = agent_tools(recipe)
    manager = get_plugin_manager()
    dataset = manager.get("dataset", config.section("data").name).build(config.section("data"), tokenizer)
    algorithm = manager.get("algorithm", "sft").build(config.section("algorithm"))
    reg = manager.get("training_backend", "fsdp2")
    trainer = LocalTrainer.build(reg, config, config.section(reg.section), Placement(device="cpu"))
    history, started = [], time.perf_counter()
    with heartbeat():
        for step in range(1, steps + 1):
            first = (step - 1) * batch_size
            indices = [(first + i) % len(dataset.train) for i in range(batch_size)]
            conversations = [tool_conversation(dataset.train[i], tools[0]["function"], i % tool_every == 0) for i in indices]
            metrics = trainer.train(conversation_batch(conversations, tokenizer, tools), algorithm)
            if step % 25 == 0 or step == steps:
                history.append({"step": step, "loss": float(metrics.get("loss", float("nan"))),
                                "seconds": time.perf_counter() - started})
                print(f"tool warm start step {step:4d}  loss {history[-1]['loss']:.4f}  ({history[-1]['seconds']:.0f}s)", flush=True)
    trainer.backend.export_hf(str(out_dir))
    tokenizer.save_pretrained(out_dir)
    trainer.shutdown()
    (out_dir / "tool_warm_start.json").write_text(json.dumps({"tool_every": tool_every, "history": history}, indent=2))
    return history[-1]
